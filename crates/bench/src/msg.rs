//! `lanbus bench msg`: MPI-style ping-pong latency through the messaging engine, the
//! measurement of the MPI-over-DPDK paper (osu_latency against Open MPI's tcp BTL), with
//! NetPIPE's TCP ping-pong (`NPtcp`, Debian package netpipe-tcp) over the same veth as the peer.
//!
//! Two network namespaces joined by a veth pair (root). Each lanbus row runs two messaging
//! endpoints over a port of that kind (udp, afpacket, afxdp), one in each namespace, each owning
//! its port (direct mode): one sends a message of each size and waits for it to come back,
//! in three trials after a warm-up; the figure is half the mean round trip of the best trial,
//! which is what NetPIPE reports (osu_latency reports the mean of one trial). Messages up to 16 KiB go eagerly, longer ones by rendezvous
//! (RTS, CTS, then the data). The peer runs NPtcp's receiver in one namespace and its transmitter
//! in the other over the same sizes. Runs go in turns (each lanbus kind, then the peer) and a
//! figure is the median of its runs; `latency_vs_nptcp` divides lanbus's by NetPIPE's (below 1:
//! lanbus is faster).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use lanbus_msg::{Config, Match, Source};
use lanbus_node::msg::MsgNode;
use lanbus_node::process::end_with_parent;
use lanbus_port::netns::VethPair;
use lanbus_runtime::ThreadMode;

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
}

/// The tag that ends the echo side.
const STOP: u64 = u64::MAX;

/// Round trips per trial at `size` (after a tenth as many warm-up ones).
fn iterations(size: usize, quick: bool) -> usize {
    let n = ((64usize << 20) / size.max(1)).clamp(50, 2000);
    if quick {
        (n / 10).max(10)
    } else {
        n
    }
}

/// Half the mean round trip of the best of three trials, µs, for every size, through the
/// messaging engine over `kind`.
fn lanbus_latency(kind: &str, veth: &VethPair, sizes: &[usize], quick: bool) -> anyhow::Result<Vec<f64>> {
    let (pa, pb) = super::port_pair(kind, Some(veth))?;
    let rc = |name: &str| {
        let mut c = lanbus_node::config::runtime_config(name, ThreadMode::default());
        // Two endpoints that know each other's address: no discovery needed.
        c.transport.heartbeat.enabled = false;
        c
    };
    let a = MsgNode::start(pa, 1, rc("msg-a"), Config::default())?;
    let b = MsgNode::start(pb, 1, rc("msg-b"), Config::default())?;
    let (to_b, largest) = (b.addr(), sizes.iter().copied().max().unwrap_or(0));
    let timeout = Duration::from_secs(10);
    let echo = std::thread::spawn(move || -> anyhow::Result<()> {
        loop {
            let (status, data, _) = b.recv(Match::any_tag(Source::Any, 0), largest, timeout)?;
            if status.tag == STOP {
                return Ok(());
            }
            b.send(status.source, 0, status.tag, data, timeout)?;
        }
    });
    let mut out = Vec::new();
    let mut run = || -> anyhow::Result<()> {
        for &size in sizes {
            let data = vec![0x5a; size];
            let n = iterations(size, quick);
            let round_trips = |count: usize| -> anyhow::Result<f64> {
                let start = Instant::now();
                for _ in 0..count {
                    a.send(to_b, 0, size as u64, data.clone(), timeout)?;
                    let (_, back, _) =
                        a.recv(Match::exact(Source::Only(to_b), 0, size as u64), size, timeout)?;
                    if back.len() != size {
                        bail!("{size} bytes sent, {} came back", back.len());
                    }
                }
                Ok(start.elapsed().as_secs_f64() * 1e6 / count as f64 / 2.0)
            };
            round_trips(n / 10)?;
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                best = best.min(round_trips(n)?);
            }
            out.push(best);
        }
        Ok(())
    };
    let result = run();
    // Stop the echo side whatever happened (it times out by itself otherwise).
    let _ = a.send(to_b, 0, STOP, Vec::new(), timeout);
    match echo.join() {
        Ok(r) => r.context("the echo side")?,
        Err(_) => bail!("the echo side panicked"),
    }
    result?;
    Ok(out)
}

/// NetPIPE's one-way time, µs, for every size it measured from 1 byte to `upto` (NPtcp without
/// perturbations: powers of two and the sizes halfway between).
fn nptcp_latency(veth: &VethPair, upto: usize, dir: &Path) -> anyhow::Result<Vec<(usize, f64)>> {
    let upper = upto.max(1).to_string();
    let mut receiver =
        end_with_parent(veth.b.netns.command("NPtcp").args(["-l", "1", "-u", &upper, "-p", "0"]))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting NPtcp (Debian package netpipe-tcp)")?;
    let file = dir.join("np.out");
    let host = veth.b.ipv4.to_string();
    let file_s = file.display().to_string();
    let mut result = None;
    // The receiver may take a moment to listen: the transmitter fails at once if it does not.
    for _ in 0..50 {
        let out = end_with_parent(veth.a.netns.command("NPtcp").args(["-h", &host, "-l", "1", "-u", &upper]))
            .args(["-p", "0", "-o", &file_s])
            .stdin(Stdio::null())
            .output()
            .context("running NPtcp")?;
        if out.status.success() && file.exists() {
            result = Some(());
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = receiver.kill();
    let _ = receiver.wait();
    if result.is_none() {
        bail!("NPtcp's transmitter could not reach its receiver at {host}");
    }
    let text = std::fs::read_to_string(&file)?;
    let _ = std::fs::remove_file(&file);
    let mut rows = Vec::new();
    for line in text.lines() {
        let mut f = line.split_whitespace();
        let (Some(bytes), Some(_mbps), Some(secs)) = (f.next(), f.next(), f.next()) else { continue };
        if let (Ok(b), Ok(s)) = (bytes.parse::<usize>(), secs.parse::<f64>()) {
            rows.push((b, s * 1e6));
        }
    }
    if rows.is_empty() {
        bail!("NPtcp wrote no figures");
    }
    Ok(rows)
}

/// Runs the benchmark.
pub fn run(args: MsgArgs) -> anyhow::Result<()> {
    if args.sizes.is_empty() || args.sizes.contains(&0) {
        bail!("--sizes takes sizes of at least 1 byte");
    }
    if let Some(k) = args.ports.iter().find(|k| !["udp", "afpacket", "afxdp"].contains(&k.as_str())) {
        bail!("--ports: unknown kind {k:?} (udp, afpacket, afxdp)");
    }
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
    let mut lanbus: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); args.sizes.len()]; args.ports.len()];
    let mut nptcp: Vec<Vec<f64>> = vec![Vec::new(); args.sizes.len()];
    for r in 0..runs {
        for (k, kind) in args.ports.iter().enumerate() {
            eprintln!("bench msg: run {}/{runs}: {kind}", r + 1);
            let l = lanbus_latency(kind, &veth, &args.sizes, args.quick)
                .with_context(|| format!("{kind} row"))?;
            for (i, v) in l.into_iter().enumerate() {
                lanbus[k][i].push(v);
            }
        }
        if peer {
            eprintln!("bench msg: run {}/{runs}: NPtcp", r + 1);
            let np = nptcp_latency(&veth, largest, &dir)?;
            for (i, &size) in args.sizes.iter().enumerate() {
                if let Some(&(_, us)) = np.iter().find(|(b, _)| *b == size) {
                    nptcp[i].push(us);
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mut report = Report::new("msg");
    let row = |name: &str, metric: &str, v: f64, size: usize| {
        Row::new(name, metric, v).with("size_bytes", size as u64).with("mtu", args.mtu as u64)
    };
    let mut ratios = Vec::new();
    for (i, &size) in args.sizes.iter().enumerate() {
        let peer_us = median(&nptcp[i]);
        if let Some(us) = peer_us {
            report.push(row("peer:NPtcp", "latency_us", us, size));
            report.push(row("peer:NPtcp", "mb_per_s", size as f64 / us, size));
        }
        for (k, kind) in args.ports.iter().enumerate() {
            let Some(us) = median(&lanbus[k][i]) else { continue };
            report.push(row(kind, "latency_us", us, size));
            report.push(row(kind, "mb_per_s", size as f64 / us, size));
            if let Some(p) = peer_us {
                ratios.push(row(kind, "latency_vs_nptcp", us / p, size));
            }
        }
    }
    report.rows.extend(ratios);
    report.finish(args.json.as_deref())?;
    Ok(())
}
