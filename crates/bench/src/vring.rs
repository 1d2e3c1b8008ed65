//! `lanbus bench vring`: the vhost-user cache-efficiency study, reproduced.
//!
//! Runs the two-thread virtqueue model of `lanbus_ring::study` (Rx thread and guest thread pinned
//! to two CPUs) in the paper's configurations: `base` (DPDK-like: shared variables packed
//! together, 16 B descriptors, a 128 B header written per packet, 2176 B buffers, ordinary copy),
//! each factor alone (`a`..`e`), `a+d` and `all`. Runs are interleaved (run 1 of every
//! configuration, then run 2...) so background noise spreads over all of them; each row is the
//! median of `--runs` runs. Rows: metric `mpps`, and for every configuration a second row with
//! metric `ratio_to_base` (its median Mpps over base's). Where `perf stat` can count cache events,
//! rows `l1_misses_per_pkt` and `l2_misses_per_pkt` are added; otherwise the output says why not.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context};
use lanbus_ring::study::{self, Factors, StudyConfig};

use super::report::{median, Report, Row};

/// Arguments of `lanbus bench vring`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A short version (500 k packets per run: seconds on an idle 2-CPU machine).
    #[arg(long)]
    pub quick: bool,
    /// Runs per configuration (the median is reported); at least 5.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Packets per run (default 10 M, or 500 k with --quick).
    #[arg(long)]
    pub packets: Option<u64>,
    /// Write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The configurations, in the order of the paper's table.
pub const ROWS: [&str; 8] = ["base", "a", "b", "c", "d", "e", "a+d", "all"];

/// Why perf cannot count cache misses here, or `None` if it can.
fn perf_unavailable() -> Option<String> {
    let probe = |events: &str| Command::new("perf").args(["stat", "-x,", "-e", events, "true"]).output();
    match probe("instructions") {
        Err(e) => return Some(format!("`perf` not runnable ({e}); install linux-perf")),
        Ok(o) if String::from_utf8_lossy(&o.stderr).contains("<not supported>") || !o.status.success() => {
            return Some(
                "`perf stat -e instructions true` reports <not supported>: no hardware PMU \
                         (a VM without counter passthrough?)"
                    .to_string(),
            )
        }
        Ok(_) => {}
    }
    match probe("L1-dcache-load-misses,l2_rqsts.miss") {
        Ok(o) if o.status.success() && !String::from_utf8_lossy(&o.stderr).contains("<not") => None,
        _ => Some("perf counts instructions but not L1-dcache-load-misses / l2_rqsts.miss".to_string()),
    }
}

/// Runs one configuration under `perf stat` attached to this process; returns (L1, L2) misses
/// per packet (both threads; the counters also see the short setup of the run).
fn perf_misses(cfg: &StudyConfig) -> anyhow::Result<(f64, f64)> {
    let out = std::env::temp_dir().join(format!("lanbus-vring-perf-{}.csv", std::process::id()));
    let mut perf = Command::new("perf")
        .args(["stat", "-x,", "-e", "L1-dcache-load-misses,l2_rqsts.miss", "-o"])
        .arg(&out)
        .args(["-p", &std::process::id().to_string()])
        .spawn()
        .context("starting perf stat")?;
    std::thread::sleep(std::time::Duration::from_millis(300));
    let r = study::run(cfg).map_err(anyhow::Error::msg)?;
    Command::new("kill").args(["-INT", &perf.id().to_string()]).status().context("stopping perf")?;
    perf.wait()?;
    let text = std::fs::read_to_string(&out).context("reading perf output")?;
    let _ = std::fs::remove_file(&out);
    let count = |event: &str| -> anyhow::Result<f64> {
        let line =
            text.lines().find(|l| l.contains(event)).with_context(|| format!("perf gave no {event}"))?;
        let v: f64 =
            line.split(',').next().unwrap_or("").trim().parse().with_context(|| format!("perf: {line}"))?;
        Ok(v / r.packets as f64)
    };
    Ok((count("L1-dcache-load-misses")?, count("l2_rqsts.miss")?))
}

/// Runs the study.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.runs < 5 {
        bail!("--runs must be at least 5 (the report quotes medians)");
    }
    let packets = args.packets.unwrap_or(if args.quick { 500_000 } else { 10_000_000 });
    let cpus = study::allowed_cpus();
    let pin = if cpus.len() >= 2 {
        println!("pinning the Rx thread to CPU {} and the guest thread to CPU {}", cpus[0], cpus[1]);
        Some((cpus[0], cpus[1]))
    } else {
        println!("only one CPU available: running unpinned (both threads share it; numbers mean little)");
        None
    };
    let configs: Vec<(&str, Factors)> =
        ROWS.iter().map(|n| (*n, Factors::parse(n).expect("row names parse"))).collect();
    let mut mpps: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut pinned_everywhere = true;
    for run in 0..args.runs {
        for (k, (name, f)) in configs.iter().enumerate() {
            let cfg = StudyConfig { cpus: pin, ..StudyConfig::new(*f, packets) };
            let r = study::run(&cfg).map_err(anyhow::Error::msg).with_context(|| format!("config {name}"))?;
            pinned_everywhere &= r.pinned || pin.is_none();
            eprintln!("  run {}/{} {name:>4}: {:.2} Mpps", run + 1, args.runs, r.mpps());
            mpps[k].push(r.mpps());
        }
    }
    if !pinned_everywhere {
        println!("note: sched_setaffinity failed for some runs; those ran unpinned");
    }
    let medians: Vec<f64> = mpps.iter().map(|v| median(v).unwrap_or(f64::NAN)).collect();
    let base = medians[0];
    let mut report = Report::new("vring");
    for ((name, f), m) in configs.iter().zip(&medians) {
        report.push(
            Row::new(*name, "mpps", *m)
                .with("packets", packets)
                .with("runs", args.runs as u64)
                .with("buffer_bytes", f.stride() as u64),
        );
    }
    for ((name, _), m) in configs.iter().zip(&medians) {
        report.push(Row::new(*name, "ratio_to_base", m / base));
    }
    match perf_unavailable() {
        Some(why) => println!("L1/L2 misses per packet: not measured: {why}"),
        None => {
            for (name, f) in &configs {
                eprintln!("  perf stat: {name}");
                let cfg = StudyConfig { cpus: pin, ..StudyConfig::new(*f, packets) };
                match perf_misses(&cfg) {
                    Ok((l1, l2)) => {
                        report.push(Row::new(*name, "l1_misses_per_pkt", l1));
                        report.push(Row::new(*name, "l2_misses_per_pkt", l2));
                    }
                    Err(e) => println!("perf stat for {name} failed: {e:#}"),
                }
            }
        }
    }
    let best = configs.iter().zip(&medians).max_by(|a, b| a.1.total_cmp(b.1)).map(|((n, _), m)| (*n, *m));
    if let Some((name, m)) = best {
        println!(
            "best: {name} at {:.2}x base (goal: at least 3x; the paper: 2.8x for a+d, 3.7x best)",
            m / base
        );
    }
    report.finish(args.json.as_deref())?;
    Ok(())
}
