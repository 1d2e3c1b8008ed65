//! `lanbus bench fabric`: several host and I/O-box pairs on one switch, the ExpEther fabric's
//! setting, with and without rate control, with and without a CPU hog, with and without a shared
//! bottleneck; Linux TCP (iperf3) over the same switch as the peer.
//!
//! Topology (one network namespace each, all made and removed by the bench): hosts `h1..hN` on a
//! Linux bridge (the switch), the I/O boxes `d1..dN` on a second bridge behind one port of the
//! first, so every pair's traffic crosses the same link from the switch to the boxes, as the I/O
//! boxes behind one switch port in the retransmission paper's Fig. 3. A row `bottleneck=M` puts a
//! token-bucket qdisc (tbf, M Mbit/s) on that link: a real shared bottleneck with a real queue
//! and real drops, counted from `tc -s qdisc`. A row `hog=yes` runs a busy loop beside the pairs
//! for the whole run.
//!
//! Each pair is one lanbus stream (the `bench transport` peer's stream and sink roles over
//! afpacket, 8 KiB messages by default), all pairs at once; the figures are the aggregate
//! goodput, Jain's fairness index over the pairs' goodputs ((Σx)² / (n·Σx²): 1 when all are
//! equal, 1/n when one takes everything), the slowest pair's goodput, and the bottleneck's drops.
//! The peer runs N iperf3 TCP streams between the same namespaces over the same switch. Every
//! run measures rate control on, off and the peer one after another (in turns: each run starts
//! with the next one), and a figure is the median of its runs.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use clap::Args;
use lanbus_port::netns::{check_root, Netns};
use lanbus_wire::MacAddr;
use serde_json::Value;

use super::report::{median, Report, Row};
use super::transport::{peer_command, run_client, Mode, Server};

/// Options of `lanbus bench fabric`.
#[derive(Debug, Args)]
pub struct FabricArgs {
    /// Write the results in the common JSON format to this file.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// One short run per figure (a smoke test, not a measurement).
    #[arg(long)]
    pub(crate) quick: bool,
    /// Runs per figure; the median is reported (default 5, 1 with --quick).
    #[arg(long)]
    pub(crate) runs: Option<usize>,
    /// Host and I/O-box pairs on the switch.
    #[arg(long, default_value_t = 4)]
    pairs: usize,
    /// How long all pairs stream at once, seconds (default 3, 1 with --quick).
    #[arg(long)]
    pub(crate) seconds: Option<f64>,
    /// Message size of the lanbus streams, bytes.
    #[arg(long, default_value_t = 8192)]
    pub(crate) size: usize,
    /// The shared link's rate in the bottleneck rows, Mbit/s (a tbf qdisc on the switch's port
    /// toward the I/O boxes).
    #[arg(long, default_value_t = 2000)]
    bottleneck_mbit: u64,
    /// MTU of every link.
    #[arg(long, default_value_t = 9000)]
    pub(crate) mtu: usize,
    /// Rate control: the queueing delay tolerated, microseconds (default: the transport's).
    #[arg(long)]
    rc_target_us: Option<u64>,
    /// Instead of the pairs: one host and one I/O box joined by this many links, each through a
    /// switch of its own held to --path-mbit; goodput over all links against one, and the
    /// failover time when a link is cut under load.
    #[arg(long, value_name = "N")]
    pub(crate) paths: Option<usize>,
    /// Each link's rate in the --paths rows, Mbit/s (a tbf qdisc on the switch's port toward
    /// the I/O box).
    #[arg(long, default_value_t = 1000)]
    pub(crate) path_mbit: u64,
    /// After the --paths rows, fio on the remote drive over all links for this long without a
    /// cut, counting the paths taken down (5 with --quick, 0 skips).
    #[arg(long, default_value_t = 60)]
    pub(crate) soak_seconds: u64,
}

/// The switch and the pairs on it; removed on drop (each namespace takes its links with it).
struct Fabric {
    switch: Netns,
    /// The I/O boxes' bridge (held: the namespace lives as long as the fabric).
    _boxes: Netns,
    hosts: Vec<Netns>,
    devices: Vec<Netns>,
}

/// Name of the switch port toward the I/O boxes (the shared link).
const UPLINK: &str = "up0";

fn host_mac(i: usize) -> MacAddr {
    MacAddr([0x02, 0x4c, 0x42, 0x00, 0x00, i as u8 + 1])
}

fn device_mac(i: usize) -> MacAddr {
    MacAddr([0x02, 0x4c, 0x42, 0x00, 0x01, i as u8 + 1])
}

fn device_ip(i: usize) -> String {
    format!("10.77.0.{}", 101 + i)
}

/// `ip ARGS` in the initial namespace.
fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).output().context("running ip")?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

impl Fabric {
    fn build(pairs: usize, mtu: usize) -> anyhow::Result<Fabric> {
        let tag = std::process::id();
        let ns = |what: &str| {
            Netns::create(&format!("lbf{tag}-{what}")).with_context(|| format!("namespace {what}"))
        };
        let switch = ns("sw")?;
        let boxes = ns("box")?;
        let mtu_s = mtu.to_string();
        for (n, br) in [(&switch, "br0"), (&boxes, "br1")] {
            n.ip(&["link", "add", br, "type", "bridge"])?;
            n.ip(&["link", "set", br, "up"])?;
        }
        // One end in `a` named `name_a`, the other in `b` named `name_b`, enslaved to `bridge`
        // there, both up at the MTU.
        let link = |a: &Netns, name_a: &str, mac: Option<MacAddr>, b: &Netns, name_b: &str, bridge: &str| {
            let mut args = vec!["link", "add", name_a, "netns", a.name()];
            let mac_s = mac.map(|m| m.to_string());
            if let Some(m) = &mac_s {
                args.extend(["address", m.as_str()]);
            }
            args.extend(["type", "veth", "peer", "name", name_b, "netns", b.name()]);
            ip(&args)?;
            a.ip(&["link", "set", name_a, "mtu", &mtu_s, "up"])?;
            b.ip(&["link", "set", name_b, "mtu", &mtu_s, "master", bridge, "up"])?;
            anyhow::Ok(())
        };
        link(&switch, UPLINK, None, &boxes, "up1", "br1")?;
        switch.ip(&["link", "set", UPLINK, "master", "br0"])?;
        let (mut hosts, mut devices) = (Vec::new(), Vec::new());
        for i in 0..pairs {
            let h = ns(&format!("h{}", i + 1))?;
            link(&h, "eth0", Some(host_mac(i)), &switch, &format!("h{}", i + 1), "br0")?;
            h.ip(&["addr", "add", &format!("10.77.0.{}/24", i + 1), "dev", "eth0"])?;
            hosts.push(h);
            let d = ns(&format!("d{}", i + 1))?;
            link(&d, "eth0", Some(device_mac(i)), &boxes, &format!("d{}", i + 1), "br1")?;
            d.ip(&["addr", "add", &format!("{}/24", device_ip(i)), "dev", "eth0"])?;
            devices.push(d);
        }
        Ok(Fabric { switch, _boxes: boxes, hosts, devices })
    }

    /// Puts a tbf of `mbit` on the shared link, or takes it away (`None`).
    fn bottleneck(&self, mbit: Option<u64>) -> anyhow::Result<()> {
        let _ = self.switch.exec("tc", &["qdisc", "del", "dev", UPLINK, "root"]);
        if let Some(m) = mbit {
            let rate = format!("{m}mbit");
            // A burst of a few jumbo frames and a queue of 2 ms at the rate.
            let out = self.switch.exec(
                "tc",
                &[
                    "qdisc", "add", "dev", UPLINK, "root", "tbf", "rate", &rate, "burst", "64kb", "latency",
                    "2ms",
                ],
            )?;
            if !out.status.success() {
                bail!("tc tbf on the shared link: {}", String::from_utf8_lossy(&out.stderr).trim());
            }
        }
        Ok(())
    }

    /// Frames the shared link's qdisc dropped so far.
    fn bottleneck_drops(&self) -> u64 {
        let Ok(out) = self.switch.exec("tc", &["-s", "qdisc", "show", "dev", UPLINK]) else { return 0 };
        parse_dropped(&String::from_utf8_lossy(&out.stdout))
    }
}

/// The sum of the `dropped N` counts in `tc -s qdisc` output.
fn parse_dropped(text: &str) -> u64 {
    text.split("dropped ")
        .skip(1)
        .filter_map(|rest| rest.split(|c: char| !c.is_ascii_digit()).next()?.parse::<u64>().ok())
        .sum()
}

/// Jain's fairness index of `x`: 1 when all are equal, 1/n when one has everything.
pub fn jain(x: &[f64]) -> f64 {
    let sum: f64 = x.iter().sum();
    let squares: f64 = x.iter().map(|v| v * v).sum();
    if squares == 0.0 {
        return 0.0;
    }
    sum * sum / (x.len() as f64 * squares)
}

/// A busy loop beside the pairs, ended on drop.
struct Hog(Child);

impl Hog {
    fn start() -> anyhow::Result<Hog> {
        let child = Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .context("starting the CPU hog (sh)")?;
        Ok(Hog(child))
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One configuration: a CPU hog or not, the bottleneck's rate (Mbit/s) if any, and who runs.
type Case = (bool, Option<u64>, Who);

/// What one configuration measured in one run.
struct Sample {
    /// Each pair's goodput, Gbit/s.
    gbps: Vec<f64>,
    /// Frames the bottleneck dropped during it.
    drops: u64,
    /// lanbus only: the streams' mean round trip and its fabric share (less both hosts' hold),
    /// microseconds, averaged over the pairs.
    rtt_us: Option<(f64, f64)>,
}

/// What a run measures: lanbus with rate control on or off, or the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    Lanbus { rate_control: bool },
    Iperf3,
}

impl Who {
    fn row(self) -> (&'static str, &'static str) {
        match self {
            Who::Lanbus { rate_control: true } => ("lanbus", "on"),
            Who::Lanbus { rate_control: false } => ("lanbus", "off"),
            Who::Iperf3 => ("peer:iperf3-tcp", "tcp"),
        }
    }
}

/// The peer's rate control options.
fn rc_args(a: &FabricArgs, rate_control: bool) -> Vec<String> {
    // The daemons' floor of the retransmission timeout: eight processes share the cores here,
    // and a lower one fires whenever a receiver waits for a core (each timeout also halves the
    // rate when rate control is on).
    let mut v: Vec<String> = vec!["--min-rto-us".into(), "5000".into()];
    v.extend(["--rate-control".into(), if rate_control { "on" } else { "off" }.into()]);
    if rate_control {
        if let Some(us) = a.rc_target_us {
            v.extend(["--target-delay-us".into(), us.to_string()]);
        }
    }
    v
}

/// All lanbus pairs streaming at once.
fn lanbus_pairs(
    f: &Fabric,
    exe: &str,
    a: &FabricArgs,
    seconds: f64,
    rate_control: bool,
) -> anyhow::Result<(Vec<f64>, (f64, f64))> {
    let size = a.size.to_string();
    let mut sinks = Vec::new();
    for (i, d) in f.devices.iter().enumerate() {
        let mut c = peer_command(d, exe, "afpacket:eth0", host_mac(i), "sink", Mode::Adaptive);
        c.args(["--size", &size]).args(rc_args(a, rate_control));
        sinks.push(Server::start(c, &format!("sink d{}", i + 1))?);
    }
    let secs = seconds.to_string();
    let clients: Vec<_> = f
        .hosts
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let mut c = peer_command(h, exe, "afpacket:eth0", device_mac(i), "stream", Mode::Adaptive);
            c.args(["--size", &size, "--seconds", &secs]).args(rc_args(a, rate_control));
            std::thread::spawn(move || run_client(c, &format!("stream h{}", i + 1)))
        })
        .collect();
    let mut gbps = Vec::new();
    let (mut rtt, mut fabric) = (0.0, 0.0);
    for (i, c) in clients.into_iter().enumerate() {
        let v = c.join().map_err(|_| anyhow!("a stream client thread panicked"))??;
        let g = v["gbit_per_s"].as_f64().ok_or_else(|| anyhow!("stream client printed {v}"))?;
        let us = |k: &str| v[k].as_f64().unwrap_or(0.0);
        eprintln!(
            "  pair {}: {g:.2} Gbit/s, RTT {:.0} us (fabric {:.0} us), {} rate cuts, {} timeouts",
            i + 1,
            us("rtt_mean_us"),
            us("fabric_rtt_mean_us"),
            v["rate_decreases"],
            v["timeouts"]
        );
        gbps.push(g);
        rtt += us("rtt_mean_us");
        fabric += us("fabric_rtt_mean_us");
    }
    drop(sinks);
    let n = gbps.len().max(1) as f64;
    Ok((gbps, (rtt / n, fabric / n)))
}

/// All iperf3 TCP pairs at once.
fn iperf3_pairs(f: &Fabric, seconds: f64) -> anyhow::Result<Vec<f64>> {
    let mut servers = Vec::new();
    for d in &f.devices {
        let child = d
            .command("iperf3")
            .args(["-s", "-1", "-p", "5201"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting iperf3 -s")?;
        servers.push(child);
    }
    std::thread::sleep(Duration::from_millis(300));
    let secs = format!("{}", seconds.ceil().max(1.0) as u64);
    let clients: Vec<_> = f
        .hosts
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let mut c = h.command("iperf3");
            c.args(["-c", &device_ip(i), "-p", "5201", "-t", &secs, "-J"]);
            std::thread::spawn(move || c.stdin(Stdio::null()).output())
        })
        .collect();
    let mut gbps = Vec::new();
    for c in clients {
        let out = c.join().map_err(|_| anyhow!("an iperf3 client thread panicked"))??;
        let v: Value = serde_json::from_slice(&out.stdout).context("iperf3 -J output")?;
        let bps = v["end"]["sum_received"]["bits_per_second"]
            .as_f64()
            .ok_or_else(|| anyhow!("iperf3: {}", v["error"].as_str().unwrap_or("no result")))?;
        gbps.push(bps / 1e9);
    }
    for mut s in servers {
        let _ = s.kill();
        let _ = s.wait();
    }
    Ok(gbps)
}

/// Runs bench fabric.
pub fn run(a: FabricArgs) -> anyhow::Result<()> {
    check_root().map_err(|skip| anyhow!("bench fabric builds a switch of network namespaces: {skip}"))?;
    if let Some(n) = a.paths {
        return super::fabric_paths::run(&a, n);
    }
    anyhow::ensure!((2..=16).contains(&a.pairs), "--pairs must be 2..=16");
    anyhow::ensure!(a.bottleneck_mbit > 0, "--bottleneck-mbit must be positive");
    let runs = a.runs.unwrap_or(if a.quick { 1 } else { 5 }).max(1);
    let seconds = a.seconds.unwrap_or(if a.quick { 1.0 } else { 3.0 });
    anyhow::ensure!(seconds > 0.0 && seconds <= 60.0, "--seconds must be in (0, 60]");
    let exe = std::env::current_exe().context("finding this program")?.to_string_lossy().to_string();
    let iperf3 = Command::new("iperf3").arg("--version").output().is_ok();
    let fabric = Fabric::build(a.pairs, a.mtu)?;
    // One unmeasured second first: frames to a link just brought up are dropped until the kernel
    // activates its transmit queue, which its batched link-event handling does up to a second
    // later, so the first streams on a new switch lose that second to retransmission timeouts,
    // whichever setting goes first.
    eprintln!("bench fabric: warming the switch up (not measured)");
    lanbus_pairs(&fabric, &exe, &a, 1.0, false)?;
    let whos = {
        let mut w = vec![Who::Lanbus { rate_control: true }, Who::Lanbus { rate_control: false }];
        if iperf3 {
            w.push(Who::Iperf3);
        }
        w
    };
    let cases: Vec<(bool, Option<u64>)> =
        [false, true].into_iter().flat_map(|hog| [(hog, None), (hog, Some(a.bottleneck_mbit))]).collect();
    let mut samples: Vec<(Case, Sample)> = Vec::new();
    for run in 0..runs {
        for &(hog, bottleneck) in &cases {
            fabric.bottleneck(bottleneck)?;
            let _hog = hog.then(Hog::start).transpose()?;
            for k in 0..whos.len() {
                let who = whos[(k + run) % whos.len()];
                let (name, rc) = who.row();
                eprintln!(
                    "bench fabric: run {}, {name} rate control {rc}, hog {}, bottleneck {}",
                    run + 1,
                    if hog { "yes" } else { "no" },
                    bottleneck.map_or("none".to_string(), |m| format!("{m} Mbit/s"))
                );
                let before = fabric.bottleneck_drops();
                let (gbps, rtt_us) = match who {
                    Who::Lanbus { rate_control } => {
                        let (g, rtt) = lanbus_pairs(&fabric, &exe, &a, seconds, rate_control)?;
                        (g, Some(rtt))
                    }
                    Who::Iperf3 => (iperf3_pairs(&fabric, seconds)?, None),
                };
                let drops = fabric.bottleneck_drops().saturating_sub(before);
                samples.push(((hog, bottleneck, who), Sample { gbps, drops, rtt_us }));
            }
        }
    }
    let mut report = Report::new("fabric");
    let mut summary = Vec::new();
    for &(hog, bottleneck) in &cases {
        for &who in &whos {
            let mine: Vec<&Sample> =
                samples.iter().filter(|(k, _)| *k == (hog, bottleneck, who)).map(|(_, s)| s).collect();
            let figure = |f: &dyn Fn(&Sample) -> f64| median(&mine.iter().map(|s| f(s)).collect::<Vec<_>>());
            let total = figure(&|s| s.gbps.iter().sum()).unwrap_or(f64::NAN);
            let fairness = figure(&|s| jain(&s.gbps)).unwrap_or(f64::NAN);
            let slowest =
                figure(&|s| s.gbps.iter().copied().fold(f64::INFINITY, f64::min)).unwrap_or(f64::NAN);
            let drops = figure(&|s| s.drops as f64).unwrap_or(f64::NAN);
            let (name, rc) = who.row();
            let row = |metric: &str, value: f64| {
                Row::new(name, metric, value)
                    .with("rate_control", rc)
                    .with("hog", if hog { "yes" } else { "no" })
                    .with("bottleneck_mbit", bottleneck.map_or(Value::from("none"), Value::from))
                    .with("pairs", a.pairs)
                    .with("runs", mine.len())
            };
            report.push(row("aggregate_gbps", total));
            report.push(row("jain_fairness", fairness));
            report.push(row("slowest_pair_gbps", slowest));
            if bottleneck.is_some() {
                report.push(row("bottleneck_drops", drops));
            }
            if let (Some(rtt), Some(fabric)) = (
                figure(&|s| s.rtt_us.map_or(f64::NAN, |r| r.0)),
                figure(&|s| s.rtt_us.map_or(f64::NAN, |r| r.1)),
            ) {
                report.push(row("rtt_mean_us", rtt));
                report.push(row("fabric_rtt_mean_us", fabric));
            }
            summary.push(((hog, bottleneck, who), total, fairness, drops));
        }
    }
    // Rate control on against off, and lanbus against the peer, per case.
    let find = |k: (bool, Option<u64>, Who)| summary.iter().find(|s| s.0 == k).map(|s| (s.1, s.2, s.3));
    let mut lines = Vec::new();
    for &(hog, bottleneck) in &cases {
        let on = find((hog, bottleneck, Who::Lanbus { rate_control: true }));
        let off = find((hog, bottleneck, Who::Lanbus { rate_control: false }));
        let peer = find((hog, bottleneck, Who::Iperf3));
        let case = format!(
            "hog {}, bottleneck {}",
            if hog { "yes" } else { "no" },
            bottleneck.map_or("none".to_string(), |m| format!("{m} Mbit/s"))
        );
        if let (Some(on), Some(off)) = (on, off) {
            let ratio = on.0 / off.0;
            report.push(
                Row::new("lanbus", "ratio_rate_control_on_off", ratio)
                    .with("hog", if hog { "yes" } else { "no" })
                    .with("bottleneck_mbit", bottleneck.map_or(Value::from("none"), Value::from)),
            );
            let mut line = format!(
                "{case}: rate control on/off aggregate {ratio:.2}x, fairness {:.3} on, {:.3} off",
                on.1, off.1
            );
            if bottleneck.is_some() {
                line += &format!(", bottleneck drops {:.0} on, {:.0} off", on.2, off.2);
            }
            lines.push(line);
        }
        if let (Some(on), Some(peer)) = (on, peer) {
            let ratio = on.0 / peer.0;
            report.push(
                Row::new("lanbus", "ratio_vs_peer", ratio)
                    .with("rate_control", "on")
                    .with("hog", if hog { "yes" } else { "no" })
                    .with("bottleneck_mbit", bottleneck.map_or(Value::from("none"), Value::from)),
            );
            lines.push(format!(
                "{case}: lanbus (rate control on) / iperf3 TCP aggregate {ratio:.2}x, TCP fairness {:.3}",
                peer.1
            ));
        }
    }
    for row in &mut report.rows {
        row.params.insert("mtu".into(), a.mtu.into());
    }
    report.finish(a.json.as_deref())?;
    for l in lines {
        println!("{l}");
    }
    if !iperf3 {
        println!("note: peer:iperf3-tcp rows skipped: iperf3 is not installed (apt-get install iperf3)");
    }
    drop(fabric);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_index_bounds() {
        assert!((jain(&[2.0, 2.0, 2.0, 2.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[4.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
        assert!((jain(&[1.0, 3.0]) - 0.8).abs() < 1e-12);
        assert_eq!(jain(&[0.0, 0.0]), 0.0);
    }

    #[test]
    fn drops_are_read_from_tc_statistics() {
        let text = "qdisc tbf 8001: root refcnt 2 rate 2Gbit burst 64Kb lat 2ms\n \
                    Sent 123 bytes 4 pkt (dropped 17, overlimits 9 requeues 0)\n";
        assert_eq!(parse_dropped(text), 17);
        assert_eq!(parse_dropped("no statistics"), 0);
    }
}
