//! `lanbus bench fabric --paths N`: one host and one I/O box joined by N links, each through a
//! switch (a Linux bridge) of its own whose port toward the box is held to `--path-mbit` by a
//! token-bucket qdisc (a veth's own rate is the CPU's, so without it a second veth would add no
//! capacity of its own).
//!
//! Each run measures, in turns: one lanbus stream over the first link alone; the same over all N
//! (the node's ports joined as paths); and all N with the second link cut (`ip link set down`)
//! halfway through. The figures are the goodput of each, the ratio of N links to one, how many
//! paths were taken down in the uncut runs (none is right), and the failover time: the longest
//! gap between two acknowledgements of the stream's data (the sink's credits) in the cut runs.

use std::process::Command;
use std::time::Duration;

use anyhow::{anyhow, Context};
use lanbus_port::netns::Netns;
use lanbus_wire::MacAddr;
use serde_json::Value;

use super::fabric::FabricArgs;
use super::report::{median, Report, Row};
use super::transport::{peer_command, run_client, Mode, Server};

/// The host, the box and the switches.
struct Links {
    host: Netns,
    iobox: Netns,
    _switch: Netns,
}

fn mac(side: u8, link: usize) -> MacAddr {
    MacAddr([0x02, 0x4c, 0x50, side, 0x00, link as u8])
}

const HOST: u8 = 1;
const BOX: u8 = 2;

fn ok(out: std::io::Result<std::process::Output>, what: &str) -> anyhow::Result<()> {
    let out = out.with_context(|| format!("running {what}"))?;
    anyhow::ensure!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr).trim());
    Ok(())
}

impl Links {
    fn build(n: usize, mtu: usize, mbit: u64) -> anyhow::Result<Links> {
        let tag = std::process::id() % 100_000;
        let ns = |w: &str| Netns::create(&format!("lbfp{tag}-{w}")).map_err(|e| anyhow!("{e}"));
        let (switch, host, iobox) = (ns("sw")?, ns("h")?, ns("d")?);
        let mtu = mtu.to_string();
        for i in 0..n {
            let br = format!("br{i}");
            ok(switch.ip(&["link", "add", &br, "type", "bridge"]), "ip link add bridge")?;
            ok(switch.ip(&["link", "set", &br, "up"]), "bridge up")?;
            for (m, side, who) in [(&host, HOST, "h"), (&iobox, BOX, "d")] {
                let inner = format!("eth{i}");
                let outer = format!("{who}{i}");
                let out = Command::new("ip")
                    .args(["link", "add", &inner, "netns", m.name(), "type", "veth", "peer", "name", &outer])
                    .args(["netns", switch.name()])
                    .output();
                ok(out, "ip link add veth")?;
                let addr = mac(side, i).to_string();
                ok(m.ip(&["link", "set", &inner, "address", &addr, "mtu", &mtu, "up"]), "link up")?;
                ok(switch.ip(&["link", "set", &outer, "mtu", &mtu, "master", &br, "up"]), "switch port up")?;
            }
            // The switch's port toward the box holds the link to its rate.
            let rate = format!("{mbit}mbit");
            let dev = format!("d{i}");
            ok(
                switch
                    .command("tc")
                    .args(["qdisc", "add", "dev", &dev, "root", "tbf", "rate", &rate])
                    .args(["burst", "256kb", "latency", "20ms"])
                    .output(),
                "tc qdisc add tbf",
            )?;
        }
        Ok(Links { host, iobox, _switch: switch })
    }

    fn set_link(&self, link: usize, up: bool) -> anyhow::Result<()> {
        ok(
            self.host.ip(&["link", "set", &format!("eth{link}"), if up { "up" } else { "down" }]),
            "ip link set",
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    One,
    All,
    Cut,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::One => "one-link",
            Case::All => "all-links",
            Case::Cut => "all-links-one-cut",
        }
    }
}

struct Sample {
    gbps: f64,
    gap_ms: f64,
    failovers: f64,
}

fn stream(l: &Links, exe: &str, a: &FabricArgs, n: usize, seconds: f64, cut: bool) -> anyhow::Result<Sample> {
    let ports: Vec<String> = (0..n).map(|i| format!("afpacket:eth{i}")).collect();
    let size = a.size.to_string();
    let with_ports = |c: &mut Command| {
        for p in &ports[1..] {
            c.args(["--port", p]);
        }
    };
    let mut sink = peer_command(&l.iobox, exe, &ports[0], mac(HOST, 0), "sink", Mode::Adaptive);
    with_ports(&mut sink);
    sink.args(["--size", &size]);
    let sink = Server::start(sink, "sink")?;
    let mut client = peer_command(&l.host, exe, &ports[0], mac(BOX, 0), "stream", Mode::Adaptive);
    with_ports(&mut client);
    client.args(["--size", &size, "--seconds", &seconds.to_string()]);
    let client = std::thread::spawn(move || run_client(client, "stream"));
    if cut {
        std::thread::sleep(Duration::from_secs_f64(seconds / 2.0 + 0.2));
        l.set_link(1, false)?;
    }
    let v = client.join().map_err(|_| anyhow!("the stream client thread panicked"))?;
    if cut {
        l.set_link(1, true)?;
    }
    let v = v?;
    drop(sink);
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let s = Sample { gbps: f("gbit_per_s"), gap_ms: f("longest_credit_gap_ms"), failovers: f("failovers") };
    eprintln!(
        "  {:.2} Gbit/s, longest gap {:.1} ms, {} failovers, {} frames resent for a path",
        s.gbps, s.gap_ms, s.failovers, v["path_resends"]
    );
    Ok(s)
}

/// Runs the `--paths` rows.
pub fn run(a: &FabricArgs, n: usize) -> anyhow::Result<()> {
    anyhow::ensure!((2..=8).contains(&n), "--paths must be 2..=8");
    anyhow::ensure!(a.path_mbit > 0, "--path-mbit must be positive");
    let runs = a.runs.unwrap_or(if a.quick { 1 } else { 5 }).max(1);
    let seconds = a.seconds.unwrap_or(if a.quick { 1.0 } else { 3.0 });
    anyhow::ensure!((1.0..=60.0).contains(&seconds), "--seconds must be in [1, 60] with --paths");
    let exe = std::env::current_exe().context("finding this program")?.to_string_lossy().to_string();
    let links = Links::build(n, a.mtu, a.path_mbit)?;
    eprintln!("bench fabric: {n} links of {} Mbit/s; warming them up (not measured)", a.path_mbit);
    stream(&links, &exe, a, n, 1.0, false)?;
    let cases = [Case::One, Case::All, Case::Cut];
    let mut samples: Vec<(Case, Sample)> = Vec::new();
    for run in 0..runs {
        for k in 0..cases.len() {
            let case = cases[(k + run) % cases.len()];
            eprintln!("bench fabric: run {}, {}", run + 1, case.name());
            let s = match case {
                Case::One => stream(&links, &exe, a, 1, seconds, false)?,
                Case::All => stream(&links, &exe, a, n, seconds, false)?,
                Case::Cut => stream(&links, &exe, a, n, seconds, true)?,
            };
            samples.push((case, s));
        }
    }
    let mut report = Report::new("fabric");
    let figure = |case: Case, f: &dyn Fn(&Sample) -> f64| {
        median(&samples.iter().filter(|(c, _)| *c == case).map(|(_, s)| f(s)).collect::<Vec<_>>())
            .unwrap_or(f64::NAN)
    };
    let row = |case: Case, metric: &str, value: f64| {
        Row::new("lanbus", metric, value)
            .with("case", case.name())
            .with("paths", if case == Case::One { 1 } else { n })
            .with("path_mbit", a.path_mbit)
            .with("mtu", a.mtu)
            .with("runs", runs)
    };
    // The longest gap without a cut is the floor the failover time is read against: credits
    // come every few hundred microseconds, and a thread that waits for a core stretches one.
    for case in cases {
        report.push(row(case, "goodput_gbps", figure(case, &|s| s.gbps)));
        report.push(row(case, "longest_gap_ms", figure(case, &|s| s.gap_ms)));
        if case != Case::One {
            report.push(row(case, "failovers", figure(case, &|s| s.failovers)));
        }
    }
    let gap = figure(Case::Cut, &|s| s.gap_ms);
    let ratio = figure(Case::All, &|s| s.gbps) / figure(Case::One, &|s| s.gbps);
    report.push(
        Row::new("lanbus", "ratio_paths_vs_one", ratio)
            .with("paths", n)
            .with("path_mbit", a.path_mbit)
            .with("mtu", a.mtu)
            .with("runs", Value::from(runs)),
    );
    report.finish(a.json.as_deref())?;
    println!(
        "{n} links / one link: {ratio:.2}x goodput (goal 1.8x); failover: {gap:.1} ms longest gap in \
         acknowledged data (goal < 10 ms; {:.1} ms without a cut); failovers without a cut: {:.0} (goal 0)",
        figure(Case::All, &|s| s.gap_ms),
        figure(Case::All, &|s| s.failovers)
    );
    Ok(())
}
