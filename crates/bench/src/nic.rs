//! `lanbus bench nic`: the Software ExpEther paper's Fig. 5, iperf3 through a NIC that sits in
//! another machine.
//!
//! Three network namespaces: the host (`lanbus host --export tap:lanbus0`), the I/O box
//! (`lanbus device --nic tap=nic0`, its TAP bridged to a veth toward the server) and the server
//! (a fresh `iperf3 -s -1` per test, on Linux's own TCP/IP). The fabric between host and I/O box
//! is a veth pair that each port kind crosses (udp, afpacket, afxdp; `--ports`) at `--mtu`
//! (default 65000: a 64 KiB segment and its virtio-net header, as 4 KiB TLPs, then cross in two
//! frames instead of eight jumbo frames). Through the remote NIC, each way (`direction`; the
//! server sends with iperf3's `-R`): iperf3 TCP with 1 and 4 streams and UDP at the paper's
//! 1 Gbit/s (`gbit_per_s` received, the UDP rows' `loss_percent`), and UDP `-b 0` with 64-byte
//! and 1400-byte datagrams (`pps_received`, and `loss_percent`); `--tests` picks. The peer, `peer:veth`, is the same iperf3 over
//! a direct veth between the host and server namespaces, in the same run (with the kernel's
//! segmentation offloads, as the host's TAP has them too); every lanbus row carries
//! `ratio_vs_veth`. Two floors per port: `tunnel:PORT`, the same iperf3 TCP tests through a bare
//! user-space path from the host's TAP to the I/O box's (a relay on each side between its TAP
//! and the port, offloads passed through, nothing of PCIe: [`crate::nic_tunnel`]), which the
//! port's lanbus row also compares with (`ratio_vs_tunnel`); and after the rows `raw:PORT`, the
//! bare port's one-way rate in frames of the fabric's MTU (`gbit_per_s_one_way`). Runs go in
//! turns (`--runs`, default 5: every row once, then again), the daemons restarted for each; a
//! figure is the median. Table, JSON (`--json`), and PREFIX-tcp.png (`--png`): Gbit/s against
//! streams.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use lanbus_port::netns::{Netns, VethPair};

use super::interrupt::KillOnDrop;
use super::report::{median, Report, Row};
use crate::nic_tunnel::Tunnel;
use crate::plot::{write_png, Plot, Series};

/// `lanbus bench nic` options.
#[derive(Debug, Args)]
pub struct NicBenchArgs {
    /// Write the common JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the TCP plot as PREFIX-tcp.png.
    #[arg(long, default_value = "bench-nic")]
    png: String,
    /// Port kinds of the fabric, comma separated.
    #[arg(long, default_value = "udp,afpacket,afxdp")]
    ports: String,
    /// MTU of the fabric's veth pair (576 to 65000): the largest by default, since the NIC's
    /// 64 KiB segments cross the fabric as 4 KiB TLPs packed into frames of this size.
    #[arg(long, default_value_t = 65_000)]
    mtu: usize,
    /// Runs of every row, in turns; a figure is their median.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Seconds of each iperf3 test.
    #[arg(long, default_value_t = 5)]
    seconds: u32,
    /// The keyed fabric's settings of the daemons' rows (comma-separated, measured in turns):
    /// `off` (no key), `auth` (`--key`: every frame authenticated) or `encrypt` (`--key
    /// --encrypt`). With `auth` or `encrypt`, `crypto:` rows give the AEAD's own rate per core on
    /// 64 KiB frames.
    #[arg(long, value_delimiter = ',', default_value = "off", value_parser = ["off", "auth", "encrypt"])]
    security: Vec<String>,
    /// The iperf3 tests (comma-separated): `tcp1`, `tcp4` (TCP with 1 and 4 streams, host to
    /// server), `tcp1-rx` (server to host: `-R`), `udp1400-1g` and `udp1400-1g-rx` (UDP at the
    /// paper's 1 Gbit/s, each way: Gbit/s received and the loss), `udp64`, `udp1400` and
    /// `udp1400-rx` (UDP flat out, `-b 0`: packets per second received).
    #[arg(long, value_delimiter = ',', default_value = "tcp1,tcp4,tcp1-rx,udp1400-1g,udp1400-1g-rx,udp64,udp1400",
          value_parser = ["tcp1", "tcp4", "tcp1-rx", "udp1400-1g", "udp1400-1g-rx", "udp64", "udp1400", "udp1400-rx"])]
    tests: Vec<String>,
}

/// The server's address behind the remote NIC, and the host's.
const NIC_SERVER: &str = "10.88.0.2";
const NIC_HOST: &str = "10.88.0.1";
/// The server's address on the direct veth, and the host's.
const DIRECT_SERVER: &str = "10.89.0.2";
const DIRECT_HOST: &str = "10.89.0.1";

/// One iperf3 test.
#[derive(Debug, Clone, Copy)]
struct Test {
    /// Its name in the rows (`test`).
    name: &'static str,
    /// Parallel streams.
    streams: u32,
    /// UDP datagram bytes (None: TCP).
    udp: Option<u32>,
    /// A UDP sender's rate, bit/s (None: as fast as it can, `-b 0`).
    rate_bps: Option<u64>,
    /// From the server to the host (`-R`): the host receives through the remote NIC.
    reverse: bool,
}

impl Test {
    const fn tcp(name: &'static str, streams: u32, reverse: bool) -> Test {
        Test { name, streams, udp: None, rate_bps: None, reverse }
    }

    const fn udp(name: &'static str, len: u32, rate_bps: Option<u64>, reverse: bool) -> Test {
        Test { name, streams: 1, udp: Some(len), rate_bps, reverse }
    }

    /// Whether its figure is a rate (TCP, UDP at a set rate: Gbit/s received) rather than a
    /// packet rate (UDP flat out).
    fn in_gbit(&self) -> bool {
        self.udp.is_none() || self.rate_bps.is_some()
    }
}

/// The Software ExpEther paper's Fig. 5 is iperf at the link's rate in both directions: TCP and
/// UDP at 1 Gbit/s each way; UDP flat out (`-b 0`) measures how many packets the path keeps.
const TESTS: [Test; 8] = [
    Test::tcp("tcp1", 1, false),
    Test::tcp("tcp4", 4, false),
    Test::tcp("tcp1-rx", 1, true),
    Test::udp("udp1400-1g", 1400, Some(1_000_000_000), false),
    Test::udp("udp1400-1g-rx", 1400, Some(1_000_000_000), true),
    Test::udp("udp64", 64, None, false),
    Test::udp("udp1400", 1400, None, false),
    Test::udp("udp1400-rx", 1400, None, true),
];

fn ok(out: std::io::Result<std::process::Output>, what: &str) -> anyhow::Result<String> {
    let out = out.with_context(|| what.to_string())?;
    if !out.status.success() {
        bail!("{what}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The namespaces: veth.a is the host, veth.b the I/O box.
struct Net {
    veth: VethPair,
    server: Netns,
    dir: PathBuf,
}

impl Net {
    fn build(mtu: usize) -> anyhow::Result<Net> {
        let veth = VethPair::create().map_err(|s| anyhow::anyhow!("bench nic needs root: {s}"))?;
        veth.set_mtu(mtu)?;
        let server = Netns::create(&format!("lanbus-nic-srv-{}", std::process::id()))?;
        let (host, io) = (&veth.a.netns, &veth.b.netns);
        ok(io.ip(&["link", "add", "br0", "type", "bridge"]), "the box's bridge")?;
        let link = |a: &Netns, an: &str, b: &Netns, bn: &str| {
            ok(
                Command::new("ip")
                    .args(["link", "add", an, "netns", a.name(), "type", "veth", "peer", "name", bn])
                    .args(["netns", b.name()])
                    .output(),
                "a veth",
            )
        };
        link(io, "wire", &server, "eth0")?;
        link(host, "direct", &server, "direct")?;
        ok(io.ip(&["link", "set", "wire", "master", "br0", "up"]), "wire")?;
        ok(io.ip(&["link", "set", "br0", "up"]), "bridge")?;
        ok(server.ip(&["addr", "add", &format!("{NIC_SERVER}/24"), "dev", "eth0"]), "server address")?;
        ok(server.ip(&["link", "set", "eth0", "up"]), "server up")?;
        ok(server.ip(&["addr", "add", &format!("{DIRECT_SERVER}/24"), "dev", "direct"]), "direct address")?;
        ok(server.ip(&["link", "set", "direct", "up"]), "direct up")?;
        ok(host.ip(&["addr", "add", &format!("{DIRECT_HOST}/24"), "dev", "direct"]), "host direct address")?;
        ok(host.ip(&["link", "set", "direct", "up"]), "host direct up")?;
        let dir = std::env::temp_dir().join(format!("lanbus-bench-nic-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(Net { veth, server, dir })
    }

    /// Starts the I/O box and the host over `kind` and waits for the host's NIC.
    fn start(&self, kind: &str, security: &str) -> anyhow::Result<(KillOnDrop, KillOnDrop)> {
        let exe = std::env::current_exe().context("finding this program")?;
        let (host_spec, io_spec) = crate::port_specs(kind, &self.veth)?;
        let mut keyed: Vec<String> = Vec::new();
        if security != "off" {
            let key = self.dir.join("fabric.key");
            let _ = std::fs::remove_file(&key);
            lanbus_secure::KeyRing::new(lanbus_secure::FabricKey::generate(), []).write(&key, false)?;
            keyed.extend(["--key".to_string(), key.display().to_string()]);
            if security == "encrypt" {
                keyed.push("--encrypt".into());
            }
        }
        let log = |n: &str| std::fs::File::create(self.dir.join(n));
        let io = self
            .veth
            .b
            .netns
            .command(&exe.to_string_lossy())
            .args(["device", "--port", &io_spec, "--nic", "tap=nic0", "--control"])
            .arg(self.dir.join("io.ctl"))
            .args(&keyed)
            .stdout(Stdio::null())
            .stderr(log("io.log")?)
            .spawn()?;
        let io = KillOnDrop(io);
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.veth.b.netns.ip(&["link", "show", "nic0"]).is_err() {
            if Instant::now() > deadline {
                bail!("the I/O box made no TAP (see {})", self.dir.join("io.log").display());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        ok(self.veth.b.netns.ip(&["link", "set", "nic0", "master", "br0", "up"]), "TAP into the bridge")?;
        let host = self
            .veth
            .a
            .netns
            .command(&exe.to_string_lossy())
            .args(["host", "--port", &host_spec, "--export", "tap:lanbus0", "--control"])
            .arg(self.dir.join("host.ctl"))
            .args(&keyed)
            .stdout(Stdio::null())
            .stderr(log("host.log")?)
            .spawn()?;
        let host = KillOnDrop(host);
        loop {
            let o = self.veth.a.netns.ip(&["link", "show", "lanbus0"]);
            if o.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("LOWER_UP")) {
                break;
            }
            if Instant::now() > deadline {
                bail!("the host's NIC did not come up (see {})", self.dir.join("host.log").display());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        ok(
            self.veth.a.netns.ip(&["addr", "add", &format!("{NIC_HOST}/24"), "dev", "lanbus0"]),
            "NIC address",
        )?;
        // The bridge learns the NIC's MAC, ARP settles.
        let _ = self.veth.a.netns.exec("ping", &["-c", "1", "-W", "2", NIC_SERVER]);
        Ok((io, host))
    }

    /// Joins the host's `lanbus0` and the I/O box's `nic0` by the floor's relays over `kind`.
    fn start_tunnel(&self, kind: &str) -> anyhow::Result<Tunnel> {
        let (mut a, mut b) = crate::port_specs(kind, &self.veth)?;
        if kind == "afpacket" {
            // Nothing paces the relays as the transport's window paces lanbus: the receive ring
            // a port has for every EtherType (sixteen times as many slots) keeps a window of TCP
            // segments from overflowing it; the relays ignore the link's other frames.
            a.push_str(",ethertypes=all");
            b.push_str(",ethertypes=all");
        }
        let a = self.veth.a.netns.run(move || {
            a.parse::<lanbus_port::PortSpec>().and_then(|s| s.open()).map_err(|e| e.to_string())
        })?;
        let b = self.veth.b.netns.run(move || {
            b.parse::<lanbus_port::PortSpec>().and_then(|s| s.open()).map_err(|e| e.to_string())
        })?;
        let (a, b) = (a.map_err(anyhow::Error::msg)?, b.map_err(anyhow::Error::msg)?);
        let tunnel = Tunnel::start(&self.veth.a.netns, "lanbus0", a, &self.veth.b.netns, "nic0", b)?;
        ok(self.veth.b.netns.ip(&["link", "set", "nic0", "master", "br0", "up"]), "TAP into the bridge")?;
        ok(
            self.veth.a.netns.ip(&["addr", "add", &format!("{NIC_HOST}/24"), "dev", "lanbus0"]),
            "tunnel address",
        )?;
        let _ = self.veth.a.netns.exec("ping", &["-c", "1", "-W", "2", NIC_SERVER]);
        Ok(tunnel)
    }

    /// One iperf3 test with `server`: (Gbit/s received, pps received, loss %).
    fn iperf3(&self, server: &str, seconds: u32, test: Test) -> anyhow::Result<(f64, f64, f64)> {
        let Test { streams, udp, rate_bps, reverse, .. } = test;
        let mut args: Vec<String> = [
            "-c",
            server,
            "-t",
            &seconds.to_string(),
            "-P",
            &streams.to_string(),
            "--json",
            "--connect-timeout",
            "5000",
        ]
        .map(String::from)
        .to_vec();
        if let Some(len) = udp {
            let rate = rate_bps.unwrap_or(0).to_string();
            args.extend(["-u", "-b", &rate, "-l", &len.to_string()].map(String::from));
        }
        if reverse {
            args.push("-R".into());
        }
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        // A fresh server per test: after a UDP flood an old one may still be busy.
        let srv = self
            .server
            .command("iperf3")
            .args(["-s", "-1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting iperf3 -s (Debian package iperf3; scripts/setup installs it)")?;
        let _srv = KillOnDrop(srv);
        std::thread::sleep(Duration::from_millis(200));
        let out = ok(self.veth.a.netns.exec("iperf3", &refs), "iperf3")?;
        let v: serde_json::Value = serde_json::from_str(&out).context("iperf3's JSON")?;
        if let Some(e) = v["error"].as_str() {
            bail!("iperf3: {e}");
        }
        let end = &v["end"];
        if udp.is_some() {
            let s = &end["sum"];
            let packets = s["packets"].as_f64().unwrap_or(0.0);
            let lost = s["lost_packets"].as_f64().unwrap_or(0.0);
            let secs = s["seconds"].as_f64().filter(|s| *s > 0.0).unwrap_or(f64::from(seconds));
            let bps = s["bits_per_second"].as_f64().unwrap_or(0.0);
            Ok((
                bps * (1.0 - lost / packets.max(1.0)) / 1e9,
                (packets - lost) / secs,
                s["lost_percent"].as_f64().unwrap_or(0.0),
            ))
        } else {
            let bps = end["sum_received"]["bits_per_second"].as_f64().context("iperf3's received rate")?;
            Ok((bps / 1e9, 0.0, 0.0))
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = &self.server;
    }
}

/// How a row's traffic goes from the host to the server.
enum Path {
    /// The direct veth (the peer).
    Direct,
    /// Through the remote NIC: the I/O box's and the host's daemons.
    Daemons { _daemons: (KillOnDrop, KillOnDrop) },
    /// Through the floor's relays.
    Tunnel(Tunnel),
}

/// (row, test) -> the runs' (Gbit/s, pps received, loss %).
type Samples = std::collections::BTreeMap<(String, &'static str), Vec<(f64, f64, f64)>>;

/// Runs `lanbus bench nic`.
pub fn run(args: NicBenchArgs) -> anyhow::Result<()> {
    let ports: Vec<String> =
        args.ports.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
    for p in &ports {
        if !["udp", "afpacket", "afxdp"].contains(&p.as_str()) {
            bail!("--ports: {p:?} is not udp, afpacket or afxdp");
        }
    }
    if args.runs == 0 || args.seconds == 0 {
        bail!("--runs and --seconds must be at least 1");
    }
    if !(576..=65_000).contains(&args.mtu) {
        bail!("--mtu: {} is not an MTU of 576 to 65000", args.mtu);
    }
    let net = Net::build(args.mtu)?;
    let securities: Vec<&str> =
        crate::SECURITY.into_iter().filter(|s| args.security.iter().any(|a| a == s)).collect();
    // A row's label: its name, and its keyed fabric's setting when it is not `off`.
    let mut rows: Vec<String> = vec!["peer:veth".to_string()];
    for p in &ports {
        for s in &securities {
            rows.push(if *s == "off" { p.clone() } else { format!("{p} {s}") });
        }
        rows.push(format!("tunnel:{p}"));
    }
    let split = |row: &str| -> (String, Option<String>) {
        match row.split_once(' ') {
            Some((name, s)) => (name.to_string(), Some(s.to_string())),
            None if row.starts_with("peer:") || row.starts_with("tunnel:") => (row.to_string(), None),
            None => (row.to_string(), Some("off".to_string())),
        }
    };
    let mut samples: Samples = Default::default();
    let mut raw: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    for run in 0..args.runs {
        for row in &rows {
            eprintln!("bench nic: run {}/{} {row}", run + 1, args.runs);
            let path = if row == "peer:veth" {
                Path::Direct
            } else if let Some(kind) = row.strip_prefix("tunnel:") {
                Path::Tunnel(net.start_tunnel(kind)?)
            } else {
                let (kind, security) = split(row);
                Path::Daemons { _daemons: net.start(&kind, security.as_deref().unwrap_or("off"))? }
            };
            let server = if matches!(path, Path::Direct) { DIRECT_SERVER } else { NIC_SERVER };
            for test in TESTS.iter().filter(|t| args.tests.iter().any(|n| n == t.name)) {
                // The tunnel is the floor of the TCP goal; one thread a side moving each small
                // packet alone is not the floor of a packet rate.
                if matches!(path, Path::Tunnel(_)) && test.udp.is_some() {
                    continue;
                }
                match net.iperf3(server, args.seconds, *test) {
                    Ok(s) => samples.entry((row.clone(), test.name)).or_default().push(s),
                    Err(e) => eprintln!("bench nic: {row} {}: {e:#}", test.name),
                }
            }
            if let Path::Tunnel(t) = path {
                match t.stop() {
                    Ok([h, b]) if h.dropped + b.dropped > 0 => eprintln!(
                        "bench nic: {row}: the relays dropped {} pieces (host: {} frames sent, {} delivered; \
                         I/O box: {} sent, {} delivered; {} other frames ignored)",
                        h.dropped + b.dropped,
                        h.sent,
                        h.delivered,
                        b.sent,
                        b.delivered,
                        h.foreign + b.foreign
                    ),
                    Ok(_) => {}
                    Err(e) => eprintln!("bench nic: {row}: {e:#}"),
                }
            }
        }
        for p in &ports {
            match super::nvme::raw_one_way(p, Some(&net.veth), 2.0) {
                Ok(g) => raw.entry(p.clone()).or_default().push(g),
                Err(e) => eprintln!("bench nic: raw:{p}: {e:#}"),
            }
        }
    }
    let mut report = Report::new("nic");
    for row in crate::crypto_rows(&args.security, args.runs) {
        report.push(row);
    }
    let med = |v: &[(f64, f64, f64)], k: usize| {
        median(&v.iter().map(|s| [s.0, s.1, s.2][k]).collect::<Vec<_>>()).unwrap_or(0.0)
    };
    let mut series = Vec::new();
    for row in &rows {
        let mut points = Vec::new();
        for t in &TESTS {
            let Some(v) = samples.get(&(row.clone(), t.name)) else { continue };
            let peer = samples.get(&("peer:veth".to_string(), t.name)).filter(|_| row != "peer:veth");
            let (name, security) = split(row);
            let tunnel = samples.get(&(format!("tunnel:{name}"), t.name));
            // The figure (Gbit/s or packets per second) this test compares.
            let k = if t.in_gbit() { 0 } else { 1 };
            let x = med(v, k);
            let mut r = if t.in_gbit() {
                if t.udp.is_none() && !t.reverse {
                    points.push((f64::from(t.streams), x));
                }
                Row::new(&name, "gbit_per_s", x)
            } else {
                Row::new(&name, "pps_received", x)
            };
            if t.udp.is_some() {
                r = r.with("loss_percent", med(v, 2));
            }
            if let Some(bps) = t.rate_bps {
                r = r.with("offered_gbit_per_s", bps as f64 / 1e9);
            }
            r = r.with("direction", if t.reverse { "server_to_host" } else { "host_to_server" });
            if let Some(s) = &security {
                r = r.with("security", s.as_str());
            }
            if let Some(p) = peer {
                r = r.with("ratio_vs_veth", x / med(p, k).max(1e-9));
            }
            if let Some(t) = tunnel {
                r = r.with("ratio_vs_tunnel", x / med(t, k).max(1e-9));
            }
            let r = match t.udp {
                Some(len) => r.with("datagram_bytes", len),
                None => r.with("streams", t.streams),
            };
            report.push(r.with("test", t.name).with("mtu", args.mtu).with("runs", v.len()));
        }
        series.push(Series { name: row.clone(), points });
    }
    crate::versus_security_off(&mut report, "gbit_per_s", true, None);
    crate::versus_security_off(&mut report, "pps_received", true, None);
    for (p, v) in &raw {
        report.push(
            Row::new(format!("raw:{p}"), "gbit_per_s_one_way", median(v).unwrap_or(0.0))
                .with("mtu", args.mtu)
                .with("runs", v.len()),
        );
    }
    let plot = Plot {
        title: format!("iperf3 TCP through the remote NIC (fabric MTU {})", args.mtu),
        x_label: "streams".into(),
        y_label: "Gbit/s".into(),
        x_log: false,
        y_log: false,
        legend_right: true,
        series,
    };
    let png = PathBuf::from(format!("{}-tcp.png", args.png));
    if let Err(e) = write_png(&plot, &png) {
        eprintln!("bench nic: plot: {e:#}");
    }
    report.finish(args.json.as_deref())?;
    Ok(())
}
