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
//! Two modes: `endpoint` (one [`Endpoint`] per side) and `split` (each side's sender and
//! receiver halves with the feedback queue between them, the pipeline mode, here in one thread).
//!
//! `msgs_per_s`, `gbit_per_s` and `frames_per_s` divide by the thread's CPU time (the goal is per
//! core, and the machines are shared); `msgs_per_s_wall` divides by wall time.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use std::collections::VecDeque;

use lanbus_transport::{Config, Counters, Endpoint, Feedback, ReceiveHalf, SendError, SendHalf};
use lanbus_wire::{Clock, Instant, MacAddr, MonotonicClock};

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

/// What the benchmark loop needs from one side: an [`Endpoint`], or its two halves with the
/// feedback queue between them moved by the driver (the pipeline mode, here in one thread).
trait Core {
    fn send(&mut self, now: Instant, peer: MacAddr, data: &[u8]) -> Result<(), SendError>;
    fn handle_frame(&mut self, now: Instant, frame: &[u8]);
    fn handle_timeout(&mut self, now: Instant);
    fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize>;
    /// Calls `f` on each delivered message; stops early if it returns an error.
    fn drain(&mut self, f: &mut dyn FnMut(&[u8]) -> anyhow::Result<()>) -> anyhow::Result<()>;
    fn counters(&self) -> Counters;
}

impl Core for Endpoint {
    fn send(&mut self, now: Instant, peer: MacAddr, data: &[u8]) -> Result<(), SendError> {
        Endpoint::send(self, now, peer, 0, data)
    }
    fn handle_frame(&mut self, now: Instant, frame: &[u8]) {
        Endpoint::handle_frame(self, now, frame)
    }
    fn handle_timeout(&mut self, now: Instant) {
        Endpoint::handle_timeout(self, now)
    }
    fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        Endpoint::poll_transmit(self, now, buf)
    }
    fn drain(&mut self, f: &mut dyn FnMut(&[u8]) -> anyhow::Result<()>) -> anyhow::Result<()> {
        while let Some(m) = self.poll_message() {
            f(m.data)?;
        }
        Ok(())
    }
    fn counters(&self) -> Counters {
        Endpoint::counters(self)
    }
}

/// Sender and receiver halves with the queue between them.
struct Halves {
    tx: SendHalf,
    rx: ReceiveHalf,
    queue: VecDeque<Feedback>,
}

impl Halves {
    fn new(endpoint: Endpoint) -> Self {
        let (tx, rx) = endpoint.split();
        Halves { tx, rx, queue: VecDeque::new() }
    }
}

impl Core for Halves {
    fn send(&mut self, now: Instant, peer: MacAddr, data: &[u8]) -> Result<(), SendError> {
        self.tx.send(now, peer, 0, data)
    }
    fn handle_frame(&mut self, now: Instant, frame: &[u8]) {
        self.rx.handle_frame(now, frame);
        while let Some(f) = self.rx.poll_feedback() {
            self.queue.push_back(f);
        }
    }
    fn handle_timeout(&mut self, now: Instant) {
        self.rx.handle_timeout(now);
        while let Some(f) = self.rx.poll_feedback() {
            self.queue.push_back(f);
        }
        self.tx.handle_timeout(now);
    }
    fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        // The sender side takes the queued feedback when it runs, as a TX thread would.
        while let Some(f) = self.queue.pop_front() {
            self.tx.handle_feedback(now, f);
        }
        self.tx.poll_transmit(now, buf)
    }
    fn drain(&mut self, f: &mut dyn FnMut(&[u8]) -> anyhow::Result<()>) -> anyhow::Result<()> {
        while let Some(m) = self.rx.poll_message() {
            f(m.data)?;
        }
        Ok(())
    }
    fn counters(&self) -> Counters {
        let mut c = self.tx.counters();
        c.merge(&self.rx.counters());
        c
    }
}

/// Sends `count` messages of `size` bytes from one endpoint to the other and times it.
fn run_once(size: usize, count: u64, split: bool) -> anyhow::Result<RunResult> {
    let clock = MonotonicClock::new();
    let (ma, mb) = (MacAddr::local(1), MacAddr::local(2));
    let mut config = Config::point_to_point();
    config.rate.enabled = false;
    let a = Endpoint::new(config.clone(), ma, clock.now());
    let b = Endpoint::new(config.clone(), mb, clock.now());
    if split {
        run_cores(&mut Halves::new(a), &mut Halves::new(b), mb, &config, &clock, size, count)
    } else {
        let (mut a, mut b) = (a, b);
        run_cores(&mut a, &mut b, mb, &config, &clock, size, count)
    }
}

fn run_cores<C: Core>(
    a: &mut C,
    b: &mut C,
    mb: MacAddr,
    config: &Config,
    clock: &MonotonicClock,
    size: usize,
    count: u64,
) -> anyhow::Result<RunResult> {
    let mut buf = vec![0u8; config.frame_capacity()];
    let mut msg = vec![0x5au8; size.max(8)];
    msg.truncate(size);
    let (mut sent, mut received) = (0u64, 0u64);
    let cpu_start = thread_cpu_ns();
    let start = std::time::Instant::now();
    let mut idle_rounds = 0u32;
    let mut check = |data: &[u8]| -> anyhow::Result<()> {
        if size >= 8 && data[..8] != received.to_le_bytes() {
            bail!("message {received} arrived out of order or damaged");
        }
        received += 1;
        Ok(())
    };
    loop {
        let now = clock.now();
        let mut progress = false;
        while sent < count {
            if size >= 8 {
                msg[..8].copy_from_slice(&sent.to_le_bytes());
            }
            match a.send(now, mb, &msg) {
                Ok(()) => sent += 1,
                Err(SendError::QueueFull) => break,
                Err(e) => bail!("send failed: {e}"),
            }
            progress = true;
        }
        while let Some(n) = a.poll_transmit(now, &mut buf) {
            b.handle_frame(now, &buf[..n]);
            b.drain(&mut check)?;
            progress = true;
        }
        while let Some(n) = b.poll_transmit(now, &mut buf) {
            a.handle_frame(now, &buf[..n]);
            progress = true;
        }
        if sent == count && !progress && a.counters().messages_sent == b.counters().messages_delivered {
            break;
        }
        if !progress {
            // Only coalesced ACKs or timers left: let them fire.
            let now = clock.now();
            a.handle_timeout(now);
            b.handle_timeout(now);
            idle_rounds += 1;
            if idle_rounds > 50_000_000 {
                bail!("transport stalled after {} of {count} messages", b.counters().messages_delivered);
            }
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let secs = match (cpu_start, thread_cpu_ns()) {
        (Some(s), Some(e)) if e > s => (e - s) as f64 / 1e9,
        _ => wall,
    };
    let (ca, cb) = (a.counters(), b.counters());
    if cb.messages_delivered != count {
        bail!("{} of {count} messages delivered", cb.messages_delivered);
    }
    if ca.retransmitted_frames != 0 || cb.drops() != 0 {
        bail!("lossless in-process run retransmitted or dropped frames: {ca:?}");
    }
    Ok(RunResult {
        msgs_per_s: count as f64 / secs,
        msgs_per_s_wall: count as f64 / wall,
        gbit_per_s: cb.bytes_delivered as f64 * 8.0 / secs / 1e9,
        frames_per_s: ca.data_frames_sent as f64 / secs,
    })
}

/// Runs the benchmark.
pub fn run(args: TransportCoreArgs) -> anyhow::Result<()> {
    let runs = args.runs.max(1);
    let mut report = Report::new("transport-core");
    let sizes: Vec<(usize, u64)> = match args.size {
        Some(s) if s > lanbus_wire::frame::MAX_MESSAGE_LEN => bail!("--size is at most 65536 bytes"),
        Some(s) => vec![(s, (256_000_000 / (s as u64 + 64)).max(1000))],
        None => vec![(64, 4_000_000), (1024, 1_000_000)],
    };
    for ((size, full), split) in sizes.into_iter().flat_map(|s| [(s, false), (s, true)]) {
        let count = if args.quick { full / 40 } else { full };
        let mode = if split { "split" } else { "endpoint" };
        let mut results = Vec::new();
        for _ in 0..runs {
            results
                .push(run_once(size, count, split).with_context(|| format!("{size}-byte messages, {mode}"))?);
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
                    .with("mode", mode)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_run_moves_every_message_in_order() {
        for size in [0usize, 64, 1024, 5000] {
            for split in [false, true] {
                let r = run_once(size, 3000, split).unwrap();
                assert!(r.msgs_per_s > 0.0 && r.frames_per_s > 0.0 && r.msgs_per_s_wall > 0.0);
            }
        }
    }
}
