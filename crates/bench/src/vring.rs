//! `lanbus bench vring`: the vhost-user cache-efficiency study, reproduced.
//!
//! Runs the two-thread virtqueue model of `lanbus_ring::study` (Rx thread and guest thread, by
//! default pinned to two CPUs) in the paper's configurations: `base` (DPDK-like: shared variables
//! packed together, 16 B descriptors, a 128 B header written per packet, 2176 B buffers, ordinary
//! copy), each factor alone (`a`..`e`), `a+d`, `all-b` (every factor but the non-temporal copy)
//! and `all`; `--rows` picks others (`every`: all 32 combinations). What the result depends on can
//! be varied in the same run: the guest pool's size (`--pools`, against the machine's caches),
//! where the threads run (`--placement`), busy threads on the CPUs (`--load`) and the buffers'
//! padding (`--stride`). Every combination of those is a configuration; runs are interleaved (run
//! 1 of every configuration, then run 2...) so background noise spreads over all of them, each
//! run lasts `--seconds` (its packet count set from a warm-up run), and each row is the median of
//! `--runs` runs with the minimum and maximum beside it. Rows: metric `mpps`, and for every
//! configuration a row with metric `ratio_to_base` (its median over the median of `base` under
//! the same pool, placement, load and stride). Where `perf stat` can count cache events, rows
//! `l1_misses_per_pkt` and `l2_misses_per_pkt` are added; otherwise the output says why not. The
//! table comes with the machine's cache sizes and vector width and the width of the model's copies
//! (also in the JSON: `machine`, and `copy_bytes` on each row).

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context};
use lanbus_ring::study::{self, Factors, StudyConfig};
use lanbus_ring::CopyMode;

use serde_json::Value;

use super::report::{median, Caches, Report, Row};

/// Arguments of `lanbus bench vring`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A short version: 5 runs per configuration instead of 11 (about a minute with the default
    /// rows).
    #[arg(long)]
    pub quick: bool,
    /// Runs per configuration (the median is reported); at least 5 (default 11, 5 with --quick).
    #[arg(long)]
    pub runs: Option<usize>,
    /// Seconds per run (the Rx thread stops after this long, the guest takes what it sent).
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
    /// Packets per run instead of --seconds.
    #[arg(long)]
    pub packets: Option<u64>,
    /// Configurations, comma-separated: `base`, `all`, factors joined by `+` (`a+d`), `all-`
    /// and the factors to leave out (`all-b`), or `every` for all 32 combinations.
    #[arg(long, default_value = "base,a,b,c,d,e,a+d,all-b,all")]
    pub rows: String,
    /// Guest pool sizes in buffers, comma-separated (base: 2176 B each; 8192 buffers = 17 MiB).
    /// A pool larger than the L3 makes every copy and header write miss to memory.
    #[arg(long, default_value = "8192")]
    pub pools: String,
    /// Where the two threads run, comma-separated: `split` (Rx on the first CPU this process may
    /// use, the guest on the second), `same` (both on the first: they take turns on one core),
    /// `free` (unpinned: the scheduler decides).
    #[arg(long, default_value = "split")]
    pub placement: String,
    /// Competing load, comma-separated: `none`, or CPUs joined by `+` (`0+1`), each of which gets a
    /// thread of this process spinning on it during the runs (a machine shared with other work).
    #[arg(long, default_value = "none")]
    pub load: String,
    /// Buffer layout, comma-separated: `natural` (the paper's: no padding, so (d)'s 2048 B
    /// buffers put the packets in flight in two sets of the L1) or `odd` (every buffer padded to
    /// an odd number of cache lines, as DPDK's mempool pads its objects).
    #[arg(long, default_value = "natural")]
    pub stride: String,
    /// Write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Where the two threads run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    Split,
    Same,
    Free,
}

impl Placement {
    fn parse(s: &str) -> anyhow::Result<Self> {
        Ok(match s {
            "split" => Placement::Split,
            "same" => Placement::Same,
            "free" => Placement::Free,
            _ => bail!("--placement: {s:?} is not split, same or free"),
        })
    }

    fn name(self) -> &'static str {
        match self {
            Placement::Split => "split",
            Placement::Same => "same",
            Placement::Free => "free",
        }
    }

    /// The (Rx, guest) CPUs, or `None` for unpinned.
    fn cpus(self, allowed: &[usize]) -> anyhow::Result<Option<(usize, usize)>> {
        match (self, allowed) {
            (Placement::Free, _) => Ok(None),
            (_, []) => bail!("sched_getaffinity gave no CPUs: use --placement free"),
            (Placement::Same, [c, ..]) => Ok(Some((*c, *c))),
            (Placement::Split, [r, g, ..]) => Ok(Some((*r, *g))),
            (Placement::Split, [_]) => bail!("only one CPU available: use --placement same or free"),
        }
    }
}

/// Spinning threads pinned to some CPUs, stopped on drop.
struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(cpus: &[usize]) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = cpus
            .iter()
            .map(|&c| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    study::pin_current_thread(c);
                    // Relaxed: a stop flag; nothing is published with it.
                    while !stop.load(Ordering::Relaxed) {
                        core::hint::spin_loop();
                    }
                })
            })
            .collect();
        Load { stop, threads }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        // Relaxed: see `start`.
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Parses `--load`: `none` or CPUs joined by `+`.
fn parse_load(s: &str) -> anyhow::Result<Vec<usize>> {
    if s == "none" {
        return Ok(Vec::new());
    }
    s.split('+').map(|c| c.parse::<usize>().with_context(|| format!("--load: {s:?}"))).collect()
}

/// One configuration: a row under one pool, placement, load and stride.
struct Config {
    name: String,
    factors: Factors,
    pool: usize,
    placement: Placement,
    load: String,
    spread: bool,
}

impl Config {
    fn study(&self, allowed: &[usize], packets: Option<u64>, seconds: f64) -> anyhow::Result<StudyConfig> {
        Ok(StudyConfig {
            duration: if packets.is_some() {
                None
            } else {
                Some(std::time::Duration::from_secs_f64(seconds))
            },
            pool_buffers: self.pool,
            cpus: self.placement.cpus(allowed)?,
            spread: self.spread,
            ..StudyConfig::new(self.factors, packets.unwrap_or(u64::MAX))
        })
    }

    /// Everything but the factors: the group whose `base` a ratio divides by.
    fn group(&self) -> (usize, Placement, &str, bool) {
        (self.pool, self.placement, &self.load, self.spread)
    }

    /// Runs once, under its load.
    fn run_once(
        &self,
        allowed: &[usize],
        packets: Option<u64>,
        seconds: f64,
    ) -> anyhow::Result<study::StudyResult> {
        let cfg = self.study(allowed, packets, seconds)?;
        let _load = Load::start(&parse_load(&self.load)?);
        study::run(&cfg).map_err(anyhow::Error::msg).with_context(|| format!("config {}", self.name))
    }
}

/// One run's figures.
#[derive(Debug, Clone, Copy)]
struct Sample {
    mpps: f64,
    share: f64,
    rtt: Option<f64>,
}

/// Where to split line round trips into near and far cores: `None` if they cluster (the
/// largest is less than twice the smallest), else the geometric mean of the two ends.
fn near_far_split(rtts: impl Iterator<Item = f64>) -> Option<f64> {
    let (lo, hi) = rtts.fold((f64::INFINITY, 0.0f64), |(lo, hi), r| (lo.min(r), hi.max(r)));
    (lo > 0.0 && hi > 2.0 * lo).then(|| (lo * hi).sqrt())
}

fn list(s: &str) -> impl Iterator<Item = &str> {
    s.split(',').map(str::trim).filter(|x| !x.is_empty())
}

fn configs(args: &Args) -> anyhow::Result<Vec<Config>> {
    let mut rows: Vec<(String, Factors)> = Vec::new();
    for r in list(&args.rows) {
        if r == "every" {
            rows.extend(Factors::every());
        } else {
            let f = Factors::parse(r).with_context(|| format!("--rows: {r:?} is not a configuration"))?;
            rows.push((r.to_string(), f));
        }
    }
    let pools: Vec<usize> = list(&args.pools)
        .map(|p| p.parse::<usize>().with_context(|| format!("--pools: {p:?}")))
        .collect::<anyhow::Result<_>>()?;
    let placements: Vec<Placement> =
        list(&args.placement).map(Placement::parse).collect::<anyhow::Result<_>>()?;
    let loads: Vec<String> = list(&args.load).map(String::from).collect();
    for l in &loads {
        parse_load(l)?;
    }
    let strides: Vec<bool> = list(&args.stride)
        .map(|s| match s {
            "odd" => Ok(true),
            "natural" => Ok(false),
            _ => bail!("--stride: {s:?} is not odd or natural"),
        })
        .collect::<anyhow::Result<_>>()?;
    if rows.is_empty() || pools.is_empty() || placements.is_empty() || loads.is_empty() || strides.is_empty()
    {
        bail!("--rows, --pools, --placement, --load and --stride each need at least one value");
    }
    let mut out = Vec::new();
    for &pool in &pools {
        for &placement in &placements {
            for load in &loads {
                for &spread in &strides {
                    for (name, factors) in &rows {
                        out.push(Config {
                            name: name.clone(),
                            factors: *factors,
                            pool,
                            placement,
                            load: load.clone(),
                            spread,
                        });
                    }
                }
            }
        }
    }
    Ok(out)
}

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
    let runs = args.runs.unwrap_or(if args.quick { 5 } else { 11 });
    if runs < 5 {
        bail!("--runs must be at least 5 (the report quotes medians)");
    }
    if !args.seconds.is_finite() || args.seconds <= 0.0 {
        bail!("--seconds must be positive");
    }
    let allowed = study::allowed_cpus();
    let configs = configs(&args)?;
    let mut report = Report::new("vring");
    let caches = Caches::of_cpu(allowed.first().copied().unwrap_or(0));
    println!("{}: {}", report.machine.model, caches.describe());
    let (ordinary, nt) = (CopyMode::Ordinary.store_bytes(), CopyMode::NonTemporal.store_bytes());
    println!("the model's copies store {ordinary} B per instruction (non-temporal: {nt} B), as this build compiles them");
    report.machine.caches = Some(caches);
    if let [r, g, ..] = allowed[..] {
        println!("placement split: the Rx thread on CPU {r}, the guest thread on CPU {g}");
    }
    // Every run of every configuration: (Mpps, CPU share, line round trip before it).
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); configs.len()];
    let mut pinned_everywhere = true;
    for run in 0..runs {
        for (k, c) in configs.iter().enumerate() {
            // The cache-line round trip between the two CPUs just before the run.
            let rtt = match c.study(&allowed, args.packets, args.seconds)?.cpus {
                Some((r, g)) => study::line_round_trip_ns(r, g, 20_000),
                None => None,
            };
            let r = c.run_once(&allowed, args.packets, args.seconds)?;
            pinned_everywhere &= r.pinned || c.placement == Placement::Free;
            eprintln!(
                "  run {}/{runs} {:>6} pool {} {} load {} {}: {:.2} Mpps in {:.2} s, cpu share {:.2}, \
                 line round trip {} ns",
                run + 1,
                c.name,
                c.pool,
                c.placement.name(),
                c.load,
                if c.spread { "odd" } else { "natural" },
                r.mpps(),
                r.elapsed.as_secs_f64(),
                r.cpu_share,
                rtt.map_or("-".to_string(), |ns| format!("{ns:.0}"))
            );
            samples[k].push(Sample { mpps: r.mpps(), share: r.cpu_share, rtt });
        }
    }
    let contended = configs
        .iter()
        .zip(&samples)
        .filter(|(c, _)| c.placement == Placement::Split && c.load == "none")
        .flat_map(|(_, s)| s)
        .filter(|s| s.share < 0.9)
        .count();
    if contended > 0 {
        println!(
            "note: in {contended} run(s) a thread placed on a CPU of its own had it less than 90% of the \
             time (cpu share below 0.9): other work ran on these CPUs, and those figures mean little"
        );
    }
    if !pinned_everywhere {
        println!("note: sched_setaffinity failed for some runs; those ran unpinned");
    }
    let split_at = near_far_split(samples.iter().flatten().filter_map(|s| s.rtt));
    if let Some(t) = split_at {
        println!(
            "note: the line round trip between the two CPUs changed during the bench (the host moved \
             the vCPUs): runs below {t:.0} ns are reported as cores=near, the others as cores=far"
        );
    }
    // Cells: a configuration's runs, or with two kinds of round trip, its runs of each kind.
    let mut cells: Vec<(usize, Option<&'static str>, Vec<Sample>)> = Vec::new();
    for (k, runs_of) in samples.iter().enumerate() {
        match split_at {
            Some(t) if runs_of.iter().any(|s| s.rtt.is_some()) => {
                for (class, near) in [("near", true), ("far", false)] {
                    let v: Vec<Sample> =
                        runs_of.iter().filter(|s| s.rtt.is_some_and(|r| (r < t) == near)).copied().collect();
                    if !v.is_empty() {
                        cells.push((k, Some(class), v));
                    }
                }
            }
            _ => cells.push((k, None, runs_of.clone())),
        }
    }
    let mpps_of = |v: &[Sample]| median(&v.iter().map(|s| s.mpps).collect::<Vec<_>>()).unwrap_or(f64::NAN);
    let row = |c: &Config, class: Option<&str>, metric: &str, v: f64| {
        let cfg = c.study(&allowed, None, 1.0).ok();
        let r = Row::new(c.name.clone(), metric, v)
            .with("buffer_bytes", cfg.map_or(0, |s| s.stride()) as u64)
            .with("pool_buffers", c.pool as u64)
            .with("pool_bytes", cfg.map_or(0, |s| s.pool_bytes()) as u64)
            .with("placement", c.placement.name())
            .with("load", c.load.as_str())
            .with("stride", if c.spread { "odd" } else { "natural" });
        match class {
            Some(class) => r.with("cores", class),
            None => r,
        }
    };
    let round2 = |x: f64| (x * 100.0).round() / 100.0;
    for (k, class, v) in &cells {
        let c = &configs[*k];
        let mode = if c.factors.b { CopyMode::NonTemporal } else { CopyMode::Ordinary };
        let lo = v.iter().map(|s| s.mpps).fold(f64::INFINITY, f64::min);
        let hi = v.iter().map(|s| s.mpps).fold(0.0, f64::max);
        let rtts: Vec<f64> = v.iter().filter_map(|s| s.rtt).collect();
        report.push(
            row(c, *class, "mpps", mpps_of(v))
                .with("min", round2(lo))
                .with("max", round2(hi))
                .with("runs", v.len() as u64)
                .with("copy_bytes", mode.store_bytes() as u64)
                .with(
                    "cpu_share",
                    round2(median(&v.iter().map(|s| s.share).collect::<Vec<_>>()).unwrap_or(0.0)),
                )
                .with("line_rtt_ns", median(&rtts).map_or(Value::Null, |ns| ns.round().into())),
        );
    }
    let base_of = |k: usize, class: Option<&str>| {
        cells
            .iter()
            .find(|(b, bc, _)| {
                configs[*b].factors == Factors::default()
                    && configs[*b].group() == configs[k].group()
                    && *bc == class
            })
            .map(|(_, _, v)| mpps_of(v))
    };
    for (k, class, v) in &cells {
        if let Some(base) = base_of(*k, *class) {
            report.push(row(&configs[*k], *class, "ratio_to_base", mpps_of(v) / base));
        }
    }
    match perf_unavailable() {
        Some(why) => println!("L1/L2 misses per packet: not measured: {why}"),
        None => {
            for c in &configs {
                eprintln!("  perf stat: {}", c.name);
                let _load = Load::start(&parse_load(&c.load)?);
                match perf_misses(&c.study(&allowed, args.packets, args.seconds)?) {
                    Ok((l1, l2)) => {
                        report.push(row(c, None, "l1_misses_per_pkt", l1));
                        report.push(row(c, None, "l2_misses_per_pkt", l2));
                    }
                    Err(e) => println!("perf stat for {} failed: {e:#}", c.name),
                }
            }
        }
    }
    report.finish(args.json.as_deref())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_split_only_when_two_kinds() {
        assert_eq!(near_far_split([45.0, 50.0, 61.0].into_iter()), None);
        let t = near_far_split([45.0, 380.0, 47.0, 410.0].into_iter()).unwrap();
        assert!(t > 61.0 && t < 380.0, "{t}");
        assert_eq!(near_far_split(std::iter::empty()), None);
    }

    #[test]
    fn configurations_multiply_and_parse() {
        let args = Args {
            quick: false,
            runs: None,
            seconds: 1.0,
            packets: None,
            rows: "base,all-b,every".into(),
            pools: "8192,65536".into(),
            placement: "split,same".into(),
            load: "none,0+1".into(),
            stride: "odd".into(),
            json: None,
        };
        let c = configs(&args).unwrap();
        assert_eq!(c.len(), 34 * 2 * 2 * 2);
        assert!(c.iter().any(|c| c.name == "all-b" && !c.factors.b && c.factors.a && c.factors.e));
        assert_eq!(parse_load("0+1").unwrap(), vec![0, 1]);
        assert!(configs(&Args { rows: "a+x".into(), ..args }).is_err());
    }
}
