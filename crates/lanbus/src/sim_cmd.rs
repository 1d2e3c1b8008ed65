//! `lanbus sim ...`: the simulator scenarios on the command line.
//!
//! Each command runs a scenario of `lanbus_sim::scenario` (the real transport code on a logical
//! clock), prints a table on stdout, and writes CSV and PNG files under `--out`. Stdout depends
//! only on the arguments (same seed, same output); wall-clock times and the progress bar go to
//! stderr.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use lanbus_sim::scenario::{
    latency_point, multi_session_point, transfer, Framing, LatencyParams, LatencyPoint, MultiParams,
    MultiPoint, TransferParams,
};

use lanbus_bench::plot::{write_png_with, Plot, Reference, Series};
use lanbus_bench::progress::Progress;

/// The simulator scenarios.
#[derive(Debug, Subcommand)]
pub enum SimCommand {
    /// Two transport endpoints through a faulty simulated wire: checks that every message arrives
    /// once, in order, intact. The last line is `delivered=N lost=0 duplicated=0 reordered=0
    /// corrupted=0` when all is well; otherwise the real counts, and the exit status is 1.
    Transfer(TransferArgs),
    /// The paper's Fig. 2: latency of one 7 Gbit/s session of 128-byte TLPs against the switch's
    /// loss rate. Writes latency_vs_loss.csv and latency_vs_loss.png under --out.
    LatencyVsLoss(LatencyArgs),
    /// The paper's Fig. 3: sessions of 1 MB bursts (exponential gaps, mean 11.4 ms) into one
    /// 10 Gbit/s switch port, with and without rate control. Writes multi_session.csv and
    /// multi_session.png under --out.
    MultiSession(MultiArgs),
    /// Several paths between two hosts (the transport over the multipath layer, each path a wire
    /// of its own): the goodput of four paths with one lossy against three clean ones, and the
    /// delivery times of 4 KiB messages with one of four paths cut against none. Writes paths.txt
    /// under --out when given.
    Paths(PathsArgs),
}

/// Arguments of `lanbus sim paths`.
#[derive(Debug, Args)]
pub struct PathsArgs {
    /// Each path's line rate, Gbit/s.
    #[arg(long, default_value_t = 1.0)]
    rate_gbps: f64,
    /// The lossy path's loss probability.
    #[arg(long, default_value_t = 0.05)]
    loss: f64,
    /// Megabytes of the bulk transfers.
    #[arg(long, default_value_t = 24)]
    mib: u64,
    /// 4 KiB messages of the latency runs (one every 50 µs; the cut comes after a fifth of them).
    #[arg(long, default_value_t = 2000)]
    messages: u64,
    /// Seed of every random decision.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write the report to DIR/paths.txt.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

/// Arguments of `lanbus sim transfer`.
#[derive(Debug, Args)]
pub struct TransferArgs {
    /// Messages to send (sizes 16..316 bytes, every 97th one 1..7 KB).
    #[arg(long, default_value_t = 100_000)]
    messages: u64,
    /// Probability that the wire loses a frame.
    #[arg(long, default_value_t = 0.0)]
    loss: f64,
    /// Probability that a frame is held back (up to 20 µs) so later ones overtake it.
    #[arg(long, default_value_t = 0.0)]
    reorder: f64,
    /// Probability that a frame is delivered twice.
    #[arg(long, default_value_t = 0.0)]
    duplicate: f64,
    /// Probability that 1..3 bits of a frame are flipped (the wire has no FCS).
    #[arg(long, default_value_t = 0.0)]
    corrupt: f64,
    /// Seed of every random decision.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write the report to DIR/transfer.txt.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Run over a keyed fabric: both ends behind the authentication layer (a fixed key, seeded
    /// handshakes), every frame sealed; corrupted frames are refused by their tags.
    #[arg(long)]
    keyed: bool,
    /// Turn the transport's frame checksum off (to see corruption get through).
    #[arg(long)]
    no_checksum: bool,
    /// Duplicate ACKs (ACKs acknowledging nothing new) that count a frame lost (the transport's
    /// default if unset; the retransmission paper's two ACKs with the same number is 1).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    dup_acks: Option<u32>,
}

/// Arguments of `lanbus sim latency-vs-loss`.
#[derive(Debug, Args)]
pub struct LatencyArgs {
    /// Directory for latency_vs_loss.csv and .png (created if missing).
    #[arg(long, value_name = "DIR", default_value = "sim-out")]
    out: PathBuf,
    /// Messages (TLPs) per loss rate. At 5.15 M TLPs/s, 2 M is 0.39 s of simulated time, which
    /// sees about 0.4 losses at 1e-7 and 4 at 1e-6: raise it to resolve the lowest rates.
    #[arg(long, default_value_t = 2_000_000)]
    messages: u64,
    /// Loss rates to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0,1e-7,1e-6,1e-5,1e-4,1e-3,1e-2")]
    loss_rates: Vec<f64>,
    /// Seed of the loss decisions.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Pack several TLPs per frame (off by default: one TLP per frame, as in the paper).
    #[arg(long)]
    packing: bool,
    /// Turn the transport's rate control on (off by default: one session has no queue to control).
    #[arg(long)]
    rate_control: bool,
    /// Recover from loss by selective repeat (the receiver holds frames past a hole, the sender
    /// resends only what was lost) instead of the paper's Go-Back-N.
    #[arg(long)]
    selective_repeat: bool,
    /// Duplicate ACKs (ACKs acknowledging nothing new) that count a frame lost; the paper's rule,
    /// two ACKs with the same number in a row, is 1.
    #[arg(long, value_name = "N", default_value_t = lanbus_transport::PAPER_DUP_ACK_THRESHOLD,
          value_parser = clap::value_parser!(u32).range(1..))]
    dup_acks: u32,
    /// Loss rates simulated at once (threads); the output does not depend on it.
    #[arg(long, default_value_t = 2)]
    jobs: usize,
}

/// Arguments of `lanbus sim multi-session`.
#[derive(Debug, Args)]
pub struct MultiArgs {
    /// Directory for multi_session.csv and .png (created if missing).
    #[arg(long, value_name = "DIR", default_value = "sim-out")]
    out: PathBuf,
    /// Simulated time during which bursts arrive, per point, in ms (the first 5 ms are warm-up).
    #[arg(long, default_value_t = 500)]
    duration_ms: u64,
    /// Session counts to run, comma-separated (each session offers 0.70 Gbit/s on average).
    #[arg(long, value_delimiter = ',', default_value = "1,3,4,6,7,9,10,11,13")]
    sessions: Vec<u16>,
    /// The fabric at scale instead: this many hosts (up to 1000) share the switch port, each
    /// sending the paper's 1 MB bursts at the gap that makes the port's offered utilisation each
    /// of `--utilization` (replaces `--sessions`).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1000))]
    hosts: Option<u16>,
    /// With `--hosts`: the offered utilisations of the switch port to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0.05,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8")]
    utilization: Vec<f64>,
    /// Switch output buffer per port, KiB.
    #[arg(long, default_value_t = 128)]
    buffer_kib: usize,
    /// Seed of the burst arrivals.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Points simulated at once (threads); the output does not depend on it.
    #[arg(long, default_value_t = 2)]
    jobs: usize,
    /// Rate control: queueing delay tolerated above the minimum RTT, µs (transport default if unset).
    #[arg(long)]
    rc_target_us: Option<u64>,
    /// Rate control: additive increase per RTT, Mbit/s (transport default if unset).
    #[arg(long)]
    rc_increase_mbps: Option<u64>,
    /// Duplicate ACKs (ACKs acknowledging nothing new) that count a frame lost; the paper's rule,
    /// two ACKs with the same number in a row, is 1.
    #[arg(long, value_name = "N", default_value_t = lanbus_transport::PAPER_DUP_ACK_THRESHOLD,
          value_parser = clap::value_parser!(u32).range(1..))]
    dup_acks: u32,
    /// How bursts are cut into frames: `paper`, the paper's 128-byte TLPs one per frame, or
    /// `jumbo`, 64 KiB messages over 1500-byte frames with packing. The ideal reference is
    /// counted in the same frames.
    #[arg(long, value_enum, default_value_t = FramesArg::Paper)]
    frames: FramesArg,
}

/// The framings `lanbus sim multi-session --frames` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FramesArg {
    /// 128-byte TLPs, one per frame.
    Paper,
    /// 64 KiB messages over 1500-byte frames.
    Jumbo,
}

/// Runs one scenario.
pub fn run(command: SimCommand) -> anyhow::Result<()> {
    match command {
        SimCommand::Transfer(a) => run_transfer(a),
        SimCommand::LatencyVsLoss(a) => run_latency(a),
        SimCommand::MultiSession(a) => run_multi(a),
        SimCommand::Paths(a) => run_paths(a),
    }
}

fn run_paths(a: PathsArgs) -> anyhow::Result<()> {
    use lanbus_sim::paths::{latency, transfer, PathSpec};
    check_probability("loss", a.loss)?;
    anyhow::ensure!(a.loss < 0.5, "--loss {}: use less than 0.5", a.loss);
    anyhow::ensure!(a.rate_gbps > 0.0 && a.rate_gbps <= 400.0, "--rate-gbps {}: give 0..400", a.rate_gbps);
    anyhow::ensure!(a.mib > 0 && a.messages >= 100, "--mib must be positive and --messages at least 100");
    let rate = (a.rate_gbps * 1e9) as u64;
    let us = Duration::from_micros;
    let clean = |d| PathSpec::clean(rate, us(d));
    let limit = Duration::from_secs(30);
    let bytes = a.mib << 20;
    let mut bar = Progress::new("several paths: 4 runs".to_string());
    let three = transfer(&[clean(10), clean(20), clean(30)], bytes, a.seed, limit);
    bar.set(0.25);
    let lossy = PathSpec { loss: a.loss, ..clean(15) };
    let four = transfer(&[clean(10), clean(20), clean(30), lossy], bytes, a.seed, limit);
    bar.set(0.5);
    let every = us(50);
    let paths = [clean(10), clean(10), clean(10), clean(10)];
    let mut calm = latency(&paths, 4096, a.messages, every, a.seed);
    bar.set(0.75);
    let mut cut_paths = paths;
    cut_paths[1].cut_at = Some(Duration::from_millis(1) + every * (a.messages / 5) as u32);
    let mut cut = latency(&cut_paths, 4096, a.messages, every, a.seed);
    drop(bar);
    let gbps = |r: &lanbus_sim::paths::PathsReport| r.goodput_bps() / 1e9;
    let mut out = String::new();
    out += &format!("paths of {} Gbit/s, delays 10-30 us, seed {}\n", a.rate_gbps, a.seed);
    out += &format!("goodput, three clean paths:             {:7.3} Gbit/s\n", gbps(&three));
    out += &format!(
        "goodput, four with one at loss {:<5}:    {:7.3} Gbit/s ({:.2}x; frames per path {:?}, resent {})\n",
        a.loss,
        gbps(&four),
        gbps(&four) / gbps(&three),
        four.tx_per_path,
        four.retransmitted
    );
    let q = |r: &mut lanbus_sim::paths::PathsReport, p: f64| r.latency_us.percentile(p).unwrap_or(f64::NAN);
    let (c50, c99, k50, k99) = (q(&mut calm, 50.0), q(&mut calm, 99.0), q(&mut cut, 50.0), q(&mut cut, 99.0));
    out += &format!("4 KiB messages, four paths:             p50 {c50:7.1} us  p99 {c99:7.1} us\n");
    out += &format!(
        "4 KiB messages, one of four cut:        p50 {k50:7.1} us  p99 {k99:7.1} us ({:.2}x; failovers {}, frames resent for it {})\n",
        k99 / c99,
        cut.failovers,
        cut.path_resends
    );
    print!("{out}");
    if let Some(dir) = &a.out {
        create_dir(dir)?;
        let file = dir.join("paths.txt");
        std::fs::write(&file, &out).with_context(|| format!("writing {}", file.display()))?;
    }
    Ok(())
}

fn check_probability(name: &str, p: f64) -> anyhow::Result<()> {
    anyhow::ensure!((0.0..=1.0).contains(&p), "--{name} {p}: a probability must be between 0 and 1");
    Ok(())
}

fn create_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating output directory {}", dir.display()))
}

fn run_transfer(a: TransferArgs) -> anyhow::Result<()> {
    for (name, p) in
        [("loss", a.loss), ("reorder", a.reorder), ("duplicate", a.duplicate), ("corrupt", a.corrupt)]
    {
        check_probability(name, p)?;
    }
    anyhow::ensure!(a.loss < 0.5, "--loss {}: the transfer would never finish; use less than 0.5", a.loss);
    let mut params = TransferParams::new(a.messages, a.loss, a.reorder, a.duplicate, a.corrupt, a.seed);
    params.transport.checksum = !a.no_checksum;
    params.keyed = a.keyed;
    if let Some(n) = a.dup_acks {
        params.transport.dup_ack_threshold = n;
    }
    let started = std::time::Instant::now();
    let mut bar = Progress::new(format!("transfer of {} messages", a.messages));
    let n = a.messages.max(1) as f64;
    let r = transfer(&params, &mut |done| bar.set(done as f64 / n));
    drop(bar);
    let [ab, ba] = r.wire;
    let [ca, cb] = r.counters;
    let secs = r.elapsed.as_secs_f64().max(1e-12);
    let mut out = String::new();
    out += &format!(
        "wire: 10 Gbit/s, 2 us each way, loss={} reorder={} duplicate={} corrupt={} seed={}\n",
        a.loss, a.reorder, a.duplicate, a.corrupt, a.seed
    );
    for (name, w) in [("A->B", ab), ("B->A", ba)] {
        out += &format!(
            "wire {name}: frames={} lost={} reordered={} duplicated={} corrupted={} bits_flipped={}\n",
            w.sent, w.lost, w.reordered, w.duplicated, w.corrupted, w.bits_flipped
        );
    }
    out += &format!(
        "sender: data_frames={} retransmitted={} fast_retransmits={} timeouts={} dup_acks_received={} bad_checksum={} rtt_mean_us={:.2}\n",
        ca.data_frames_sent,
        ca.retransmitted_frames,
        ca.fast_retransmits,
        ca.timeouts,
        ca.dup_acks_received,
        ca.drop_bad_checksum,
        ca.rtt_mean().map_or(0.0, |d| d.as_secs_f64() * 1e6)
    );
    out += &format!(
        "receiver: acks_sent={} dup_acks_sent={} out_of_order={} duplicate={} bad_checksum={} bad_frame={}\n",
        cb.ack_frames_sent,
        cb.dup_acks_sent,
        cb.drop_out_of_order,
        cb.drop_duplicate,
        cb.drop_bad_checksum,
        cb.drop_bad_frame
    );
    out += &format!(
        "logical time {:.3} ms, goodput {:.3} Gbit/s{}\n",
        secs * 1e3,
        r.bytes as f64 * 8.0 / secs / 1e9,
        if r.completed { "" } else { " (stopped at the time limit before completing)" }
    );
    if a.keyed {
        out += &format!("keyed fabric: {} frames refused by the authentication layers\n", r.refused_by_key);
    }
    out += &r.summary();
    out += "\n";
    print!("{out}");
    std::io::stdout().flush()?;
    eprintln!("(wall time {:.2} s)", started.elapsed().as_secs_f64());
    if let Some(dir) = &a.out {
        create_dir(dir)?;
        let path = dir.join("transfer.txt");
        std::fs::write(&path, &out).with_context(|| format!("writing {}", path.display()))?;
    }
    if r.ok() && r.completed {
        Ok(())
    } else {
        // The counts are the message; the exit status says it failed.
        std::process::exit(1)
    }
}

/// Runs `f` over `items` on `jobs` threads, results in the order of `items`.
fn parallel_map<T: Sync, R: Send>(items: &[T], jobs: usize, f: impl Fn(usize, &T) -> R + Sync) -> Vec<R> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new((0..items.len()).map(|_| None).collect::<Vec<Option<R>>>());
    std::thread::scope(|s| {
        for _ in 0..jobs.clamp(1, items.len().max(1)) {
            s.spawn(|| loop {
                // Relaxed: the counter only hands out distinct indices; results go through the mutex.
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let r = f(i, item);
                results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
            });
        }
    });
    results.into_inner().unwrap_or_else(|e| e.into_inner()).into_iter().flatten().collect()
}

/// The retransmission paper, Sec. 4, on Fig. 2: "at packet loss rates of 1e-5 and below, the 99%
/// and the mean latency are both about equal to the round-trip propagation delay".
const PAPER_FIG2_LOSS: f64 = 1e-5;

/// The retransmission paper, Sec. 4, on Fig. 3: "under this traffic, 90% throughput or more
/// needs the utilisation kept at 20% or below" (no congestion control).
const PAPER_FIG3_RATIO: f64 = 0.9;
/// See [`PAPER_FIG3_RATIO`].
const PAPER_FIG3_UTILIZATION: f64 = 0.2;

fn run_latency(a: LatencyArgs) -> anyhow::Result<()> {
    for &p in &a.loss_rates {
        check_probability("loss-rates", p)?;
    }
    anyhow::ensure!(a.messages > 0, "--messages must be positive");
    create_dir(&a.out)?;
    let started = std::time::Instant::now();
    let bar = std::sync::Mutex::new(Progress::new("latency vs loss"));
    let done = std::sync::atomic::AtomicUsize::new(0);
    let total = a.loss_rates.len() as f64;
    let points: Vec<LatencyPoint> = parallel_map(&a.loss_rates, a.jobs, |_, &loss| {
        let mut p = LatencyParams::paper(loss, a.messages, a.seed);
        p.transport.pack_messages = a.packing;
        p.transport.rate.enabled = a.rate_control;
        p.transport.selective_repeat = a.selective_repeat;
        p.transport.dup_ack_threshold = a.dup_acks;
        let r = latency_point(&p, &mut |_| {});
        // Relaxed: a count for the progress bar only.
        let k = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        bar.lock().unwrap_or_else(|e| e.into_inner()).set(k as f64 / total);
        r
    });
    drop(bar);
    let frame = points.first().map_or(0, |p| p.frame_bytes);
    println!(
        "one session, {} TLPs of 128 B offered at 7 Gbit/s (counted in the paper's 170 B frames: 5.15 M/s),",
        a.messages
    );
    println!(
        "{frame} B frames (+24 B preamble/FCS/gap) on 10 Gbit/s links of 1 us, one switch losing frames at random,"
    );
    println!(
        "{}, fast retransmit after {} duplicate ACK(s)",
        if a.selective_repeat { "selective repeat" } else { "Go-Back-N (the paper's scheme)" },
        a.dup_acks
    );
    println!(
        "{:>9} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>7}",
        "loss", "mean_us", "p99_us", "max_us", "rtt_us", "gbit/s", "retx", "lost"
    );
    let mut csv = String::from(
        "loss_rate,mean_latency_us,p99_latency_us,base_rtt_us,goodput_gbps,retransmitted_frames\n",
    );
    for p in &points {
        println!(
            "{:>9.0e} {:>10.3} {:>10.3} {:>10.3} {:>9.3} {:>9.3} {:>8} {:>7}",
            p.loss,
            p.mean_us,
            p.p99_us,
            p.max_us,
            p.base_rtt_us,
            p.goodput_gbps,
            p.retransmitted_frames,
            p.lost_frames
        );
        csv += &format!(
            "{},{:.4},{:.4},{:.4},{:.4},{}\n",
            p.loss, p.mean_us, p.p99_us, p.base_rtt_us, p.goodput_gbps, p.retransmitted_frames
        );
        anyhow::ensure!(
            p.errors == 0,
            "loss {}: {} messages arrived out of order or corrupted",
            p.loss,
            p.errors
        );
        anyhow::ensure!(
            p.delivered == a.messages,
            "loss {}: only {} messages delivered",
            p.loss,
            p.delivered
        );
    }
    let csv_path = a.out.join("latency_vs_loss.csv");
    std::fs::write(&csv_path, csv).with_context(|| format!("writing {}", csv_path.display()))?;
    let rtt = points.first().map_or(f64::NAN, |p| p.base_rtt_us);
    println!(
        "paper (Sec. 4): up to loss {PAPER_FIG2_LOSS:.0e}, mean and 99% latency are about the round trip \
         (lanbus's round trip: {rtt:.3} us)"
    );
    if let Some(base) = points.iter().find(|p| p.loss == 0.0) {
        let low = points.iter().filter(|p| p.loss > 0.0 && p.loss <= PAPER_FIG2_LOSS);
        let within = low.clone().all(|p| p.mean_us <= base.mean_us * 1.1 && p.p99_us <= base.p99_us * 1.1);
        println!(
            "claim (paper): up to 1e-5 loss, mean and p99 within 10% of loss-free: {}",
            if within { "holds" } else { "does NOT hold" }
        );
        for p in points.iter().filter(|p| p.loss >= 1e-3) {
            println!(
                "at {:.0e}: mean {:.2}x, p99 {:.2}x, goodput {:.2}x the loss-free values",
                p.loss,
                p.mean_us / base.mean_us,
                p.p99_us / base.p99_us,
                p.goodput_gbps / base.goodput_gbps
            );
        }
    }
    // Log axes: loss 0 is drawn at 1e-8.
    let x = |p: &LatencyPoint| if p.loss > 0.0 { p.loss } else { 1e-8 };
    let plot = Plot {
        title: "Fig. 2: one 7 Gbit/s session, latency vs loss (loss 0 at 1e-8)".into(),
        x_label: "frame loss rate".into(),
        y_label: "one-way latency (us)".into(),
        x_log: true,
        y_log: true,
        legend_right: false,
        series: vec![
            Series { name: "mean".into(), points: points.iter().map(|p| (x(p), p.mean_us)).collect() },
            Series {
                name: "99th percentile".into(),
                points: points.iter().map(|p| (x(p), p.p99_us)).collect(),
            },
            Series {
                name: "base RTT".into(),
                points: points.iter().map(|p| (x(p), p.base_rtt_us)).collect(),
            },
        ],
    };
    // The paper gives no microseconds: its line is drawn at lanbus's round trip.
    let paper = Reference {
        name: format!("paper (Sec. 4): mean, 99% about the round trip up to {PAPER_FIG2_LOSS:.0e}"),
        points: vec![(1e-8, rtt), (PAPER_FIG2_LOSS, rtt)],
    };
    let png = a.out.join("latency_vs_loss.png");
    write_png_with(&plot, &[paper], &png)?;
    println!("wrote {} and {}", csv_path.display(), png.display());
    eprintln!("(wall time {:.1} s)", started.elapsed().as_secs_f64());
    Ok(())
}

fn run_multi(a: MultiArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!a.sessions.is_empty(), "--sessions needs at least one count");
    anyhow::ensure!(a.sessions.iter().all(|&s| s > 0), "--sessions: counts must be positive");
    anyhow::ensure!(a.duration_ms > 5, "--duration-ms must exceed the 5 ms warm-up");
    create_dir(&a.out)?;
    let started = std::time::Instant::now();
    let duration = Duration::from_millis(a.duration_ms);
    // (sessions, mean gap between a session's bursts): the paper's gap, or with --hosts the gap
    // that offers each utilisation.
    let points: Vec<(u16, Option<Duration>)> = match a.hosts {
        None => a.sessions.iter().map(|&s| (s, None)).collect(),
        Some(h) => {
            for &u in &a.utilization {
                anyhow::ensure!(u > 0.0 && u <= 2.0, "--utilization: values in (0, 2], got {u}");
            }
            let per_host_bits = |u: f64| f64::from(h) * 1e6 * 8.0 / (u * 10e9);
            a.utilization.iter().map(|&u| (h, Some(Duration::from_secs_f64(per_host_bits(u))))).collect()
        }
    };
    let mut cases = Vec::new();
    for rc in [false, true] {
        for &(s, gap) in &points {
            let mut p = MultiParams::paper(s, rc, duration, a.seed);
            p.set_framing(match a.frames {
                FramesArg::Paper => Framing::Paper,
                FramesArg::Jumbo => Framing::Jumbo,
            });
            if let Some(g) = gap {
                p.mean_gap = g;
            }
            p.switch_buffer_bytes = a.buffer_kib * 1024;
            p.transport.dup_ack_threshold = a.dup_acks;
            if let Some(us) = a.rc_target_us {
                p.transport.rate.target_queue_delay = Duration::from_micros(us);
            }
            if let Some(mbps) = a.rc_increase_mbps {
                p.transport.rate.additive_increase_bps = mbps * 1_000_000;
            }
            cases.push(p);
        }
    }
    let bar = std::sync::Mutex::new(Progress::new("multi-session"));
    let done = std::sync::atomic::AtomicUsize::new(0);
    let n = cases.len() as f64;
    // The work of a point grows with its offered load (and beyond the port's rate with the
    // retransmissions): the heaviest go first, so the threads finish together.
    let mut order: Vec<usize> = (0..cases.len()).collect();
    order.sort_by(|&x, &y| cases[y].utilization().total_cmp(&cases[x].utilization()));
    let results: Vec<MultiPoint> = parallel_map(&order, a.jobs, |_, &i| {
        let r = multi_session_point(&cases[i], &mut |_| {});
        // Relaxed: a count for the progress bar only.
        let k = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        bar.lock().unwrap_or_else(|e| e.into_inner()).set(k as f64 / n);
        r
    });
    let mut points: Vec<Option<MultiPoint>> = vec![None; cases.len()];
    for (&i, r) in order.iter().zip(results) {
        points[i] = Some(r);
    }
    let points: Vec<MultiPoint> = points.into_iter().flatten().collect();
    drop(bar);
    match a.hosts {
        None => println!(
            "sessions of 1 MB bursts, exponential gaps of mean 11.4 ms (0.70 Gbit/s each), {} ms of arrivals per point,",
            a.duration_ms
        ),
        Some(h) => println!(
            "{h} hosts sending 1 MB bursts at exponential gaps set for each utilisation, {} ms of arrivals per point,",
            a.duration_ms
        ),
    }
    println!("10 Gbit/s links of 1 us into one switch port with {} KiB of buffer", a.buffer_kib);
    match a.frames {
        FramesArg::Paper => println!(
            "bursts in the paper's 128 B TLPs, one per {} B frame (the paper's are 170 B), the burst's header in its first TLP;",
            cases[0].transport.frame_capacity()
        ),
        FramesArg::Jumbo => println!("bursts in 64 KiB messages over 1500 B frames, packed (--frames jumbo);"),
    }
    println!(
        "ideal: a burst's frames back to back at 10 Gbit/s ({} B on the line, preamble/FCS/gap included);",
        cases[0].burst_wire_bytes()
    );
    println!("util: the sessions' data over the port's rate (the paper's axis); line_util: the same in those frames");
    println!(
        "{:>8} {:>6} {:>9} {:>5} {:>10} {:>9} {:>7} {:>7} {:>8} {:>8} {:>8}",
        "sessions",
        "util",
        "line_util",
        "rc",
        "mean_ratio",
        "p10_ratio",
        "ideal",
        "bursts",
        "drops",
        "retx",
        "timeouts"
    );
    let mut csv = String::from(
        "sessions,utilization,rate_control,mean_throughput_ratio,p10_throughput_ratio,switch_drops,retransmitted_frames,ideal_mean_throughput_ratio,line_utilization\n",
    );
    for p in &points {
        println!(
            "{:>8} {:>6.3} {:>9.3} {:>5} {:>10.3} {:>9.3} {:>7.3} {:>7} {:>8} {:>8} {:>8}",
            p.sessions,
            p.utilization,
            p.line_utilization,
            if p.rate_control { "on" } else { "off" },
            p.mean_ratio,
            p.p10_ratio,
            p.ideal_mean_ratio,
            p.bursts,
            p.switch_drops,
            p.retransmitted_frames,
            p.timeouts
        );
        csv += &format!(
            "{},{:.4},{},{:.4},{:.4},{},{},{:.4},{:.4}\n",
            p.sessions,
            p.utilization,
            p.rate_control,
            p.mean_ratio,
            p.p10_ratio,
            p.switch_drops,
            p.retransmitted_frames,
            p.ideal_mean_ratio,
            p.line_utilization
        );
        if p.incomplete > 0 {
            println!("  warning: {} bursts of this point did not complete before the bound", p.incomplete);
        }
    }
    let csv_path = a.out.join("multi_session.csv");
    std::fs::write(&csv_path, csv).with_context(|| format!("writing {}", csv_path.display()))?;
    // The paper's claims, checked on these numbers.
    let off: Vec<&MultiPoint> = points.iter().filter(|p| !p.rate_control).collect();
    let on: Vec<&MultiPoint> = points.iter().filter(|p| p.rate_control).collect();
    let below = off.iter().filter(|p| p.utilization > 0.25).all(|p| p.mean_ratio < 0.9);
    println!(
        "claim (paper): without rate control the mean ratio is below 0.9 beyond ~20% utilisation: {}",
        if below { "holds" } else { "does NOT hold" }
    );
    let better = off
        .iter()
        .zip(&on)
        .filter(|(f, _)| f.utilization >= 0.28)
        .all(|(f, n)| n.mean_ratio > f.mean_ratio && n.switch_drops <= f.switch_drops);
    println!(
        "claim (lanbus): with rate control, fewer drops and a higher mean ratio from 30% up: {}",
        if better { "holds" } else { "does NOT hold" }
    );
    // The utilisation up to which bursts keep 90% of their ideal rate on average.
    let reach = |pts: &[&MultiPoint]| {
        let mut sorted: Vec<&&MultiPoint> = pts.iter().collect();
        sorted.sort_by(|x, y| x.utilization.total_cmp(&y.utilization));
        sorted.iter().take_while(|p| p.mean_ratio >= 0.9).last().map_or(0.0, |p| p.utilization)
    };
    let (reach_off, reach_on) = (reach(&off), reach(&on));
    let reach_ideal = {
        let mut sorted: Vec<&&MultiPoint> = off.iter().collect();
        sorted.sort_by(|x, y| x.utilization.total_cmp(&y.utilization));
        sorted.iter().take_while(|p| p.ideal_mean_ratio >= 0.9).last().map_or(0.0, |p| p.utilization)
    };
    println!(
        "an ideal fabric (the port shared equally among the bursts under way, nothing lost) keeps the mean \
         ratio at or above 0.9 up to utilisation {reach_ideal:.2}"
    );
    println!(
        "paper (Sec. 4): without congestion control, a mean ratio of {PAPER_FIG3_RATIO} or more needs utilisation \
         {PAPER_FIG3_UTILIZATION:.2} or less; lanbus without rate control: up to {reach_off:.2}"
    );
    println!(
        "mean ratio at or above 0.9 up to utilisation {reach_off:.2} without rate control, {reach_on:.2} with it, \
         {reach_ideal:.2} on the ideal fabric"
    );
    let line =
        |pts: &[&MultiPoint], f: fn(&MultiPoint) -> f64| pts.iter().map(|p| (p.utilization, f(p))).collect();
    let plot = Plot {
        title: "Fig. 3: 1 MB bursts through one 10 Gbit/s switch port".into(),
        x_label: "utilisation of the switch output port".into(),
        y_label: "throughput ratio (ideal / actual burst time)".into(),
        x_log: false,
        y_log: false,
        legend_right: true,
        series: vec![
            Series { name: "mean, no rate control".into(), points: line(&off, |p| p.mean_ratio) },
            Series { name: "mean, rate control".into(), points: line(&on, |p| p.mean_ratio) },
            Series { name: "mean, ideal sharing".into(), points: line(&off, |p| p.ideal_mean_ratio) },
            Series { name: "10th pct, no rate control".into(), points: line(&off, |p| p.p10_ratio) },
            Series { name: "10th pct, rate control".into(), points: line(&on, |p| p.p10_ratio) },
        ],
    };
    let paper = Reference {
        name: "paper (Sec. 4): 90% only up to 20% utilisation, no control".into(),
        points: vec![
            (0.0, PAPER_FIG3_RATIO),
            (PAPER_FIG3_UTILIZATION, PAPER_FIG3_RATIO),
            (PAPER_FIG3_UTILIZATION, 0.0),
        ],
    };
    let png = a.out.join("multi_session.png");
    write_png_with(&plot, &[paper], &png)?;
    println!("wrote {} and {}", csv_path.display(), png.display());
    eprintln!("(wall time {:.1} s)", started.elapsed().as_secs_f64());
    Ok(())
}
