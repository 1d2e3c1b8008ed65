//! `lanbus bench transport-core`: messages per second through two transport endpoints in one
//! thread, with every frame handed from one core to the other directly (no port, no wire delay).
//!
//! This measures the protocol core alone: segmentation and packing, checksums, Go-Back-N
//! bookkeeping, in-order acceptance, ACK coalescing and delivery. There is no peer program for an
//! in-process core, so unlike the other benchmarks no `peer:` row is printed; the frames per second
//! are reported alongside so the per-frame and per-message costs can be told apart. Rate control is
//! off (pacing would measure the configured line rate, not the code); everything else is the
//! default configuration (checksums on, packing on, ACK every 4 frames).
//!
//! `msgs_per_s`, `gbit_per_s` and `frames_per_s` divide by the thread's CPU time (the goal is per
//! core, and the machines are shared); `msgs_per_s_wall` divides by wall time.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use lanbus_transport::{Config, Endpoint, SendError};
use lanbus_wire::{Clock, MacAddr, MonotonicClock};

use super::report::{median, Report, Row};

/// Options of `lanbus bench transport-core`.
#[derive(Debug, Args)]
pub struct TransportCoreArgs {
    /// Write the results in the common JSON format to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Fewer messages per run (a smoke test, not a measurement).
    #[arg(long)]
    quick: bool,
    /// Runs per message size; the median is reported.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Measure only this message size (default: 64 and 1024 bytes).
    #[arg(long)]
    size: Option<usize>,
}

/// This thread's CPU time in nanoseconds, from `/proc/thread-self/schedstat` (the first field is
/// the time spent on a CPU). The machines we measure on are shared, so wall time includes other
/// processes' turns; CPU time is the "per core" figure.
fn thread_cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

struct RunResult {
    msgs_per_s: f64,
    msgs_per_s_wall: f64,
    gbit_per_s: f64,
    frames_per_s: f64,
}

/// Sends `count` messages of `size` bytes from one endpoint to the other and times it.
fn run_once(size: usize, count: u64) -> anyhow::Result<RunResult> {
    let clock = MonotonicClock::new();
    let (ma, mb) = (MacAddr::local(1), MacAddr::local(2));
    let mut config = Config::point_to_point();
    config.rate.enabled = false;
    let mut a = Endpoint::new(config.clone(), ma, clock.now());
    let mut b = Endpoint::new(config.clone(), mb, clock.now());
    let mut buf = vec![0u8; config.frame_capacity()];
    let mut msg = vec![0x5au8; size.max(8)];
    msg.truncate(size);
    let (mut sent, mut received, mut bytes) = (0u64, 0u64, 0u64);
    let cpu_start = thread_cpu_ns();
    let start = std::time::Instant::now();
    let mut idle_rounds = 0u32;
    while received < count {
        let now = clock.now();
        let mut progress = false;
        while sent < count {
            if size >= 8 {
                msg[..8].copy_from_slice(&sent.to_le_bytes());
            }
            match a.send(now, mb, 0, &msg) {
                Ok(()) => sent += 1,
                Err(SendError::QueueFull) => break,
                Err(e) => bail!("send failed: {e}"),
            }
            progress = true;
        }
        while let Some(n) = a.poll_transmit(now, &mut buf) {
            b.handle_frame(now, &buf[..n]);
            while let Some(m) = b.poll_message() {
                if size >= 8 && m.data[..8] != received.to_le_bytes() {
                    bail!("message {received} arrived out of order or damaged");
                }
                received += 1;
                bytes += m.data.len() as u64;
            }
            progress = true;
        }
        while let Some(n) = b.poll_transmit(now, &mut buf) {
            a.handle_frame(now, &buf[..n]);
            progress = true;
        }
        if !progress {
            // Only coalesced ACKs or timers left: let them fire.
            let now = clock.now();
            a.handle_timeout(now);
            b.handle_timeout(now);
            idle_rounds += 1;
            if idle_rounds > 50_000_000 {
                bail!("transport stalled after {received} of {count} messages");
            }
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let secs = match (cpu_start, thread_cpu_ns()) {
        (Some(a), Some(b)) if b > a => (b - a) as f64 / 1e9,
        _ => wall,
    };
    let c = a.counters();
    if c.retransmitted_frames != 0 || b.counters().drops() != 0 {
        bail!("lossless in-process run retransmitted or dropped frames: {c:?}");
    }
    Ok(RunResult {
        msgs_per_s: count as f64 / secs,
        msgs_per_s_wall: count as f64 / wall,
        gbit_per_s: bytes as f64 * 8.0 / secs / 1e9,
        frames_per_s: c.data_frames_sent as f64 / secs,
    })
}

/// Runs the benchmark.
pub fn run(args: TransportCoreArgs) -> anyhow::Result<()> {
    let runs = args.runs.max(1);
    let mut report = Report::new("transport-core");
    let sizes: Vec<(usize, u64)> = match args.size {
        Some(s) if s > lanbus_wire::lanbus::MAX_MESSAGE_LEN => bail!("--size is at most 65536 bytes"),
        Some(s) => vec![(s, (256_000_000 / (s as u64 + 64)).max(1000))],
        None => vec![(64, 4_000_000), (1024, 1_000_000)],
    };
    for (size, full) in sizes {
        let count = if args.quick { full / 40 } else { full };
        let mut results = Vec::new();
        for _ in 0..runs {
            results.push(run_once(size, count).with_context(|| format!("{size}-byte messages"))?);
        }
        let med =
            |f: fn(&RunResult) -> f64| median(&results.iter().map(f).collect::<Vec<_>>()).unwrap_or(0.0);
        for (metric, value) in [
            ("msgs_per_s", med(|r| r.msgs_per_s)),
            ("msgs_per_s_wall", med(|r| r.msgs_per_s_wall)),
            ("gbit_per_s", med(|r| r.gbit_per_s)),
            ("frames_per_s", med(|r| r.frames_per_s)),
        ] {
            report.push(
                Row::new("transport-core", metric, value)
                    .with("size_bytes", size)
                    .with("runs", runs)
                    .with("messages", count),
            );
        }
    }
    report.finish(args.json.as_deref())?;
    println!(
        "(no peer program exists for an in-process protocol core; goal: >= 10 million 64 B msgs/s per core)"
    );
    Ok(())
}
