//! One side of `lanbus bench transport`, run by the bench inside a network namespace (hidden
//! subcommand `lanbus bench transport-peer`): a lanbus server (echo, sink, idle) or client (ping,
//! stream), or the bare port's raw echo server and ping client, each printing one JSON line of
//! results.
//!
//! Layer: measurement.

use super::*;

/// Options of the hidden `lanbus bench transport-peer` (one side of `bench transport`).
#[derive(Debug, Args)]
pub struct PeerArgs {
    /// The port spec to open; given more than once, the ports are paths of one node.
    #[arg(long, required = true)]
    port: Vec<lanbus_port::PortSpec>,
    /// The other side's MAC address.
    #[arg(long)]
    peer: String,
    /// What to do.
    #[arg(long, value_enum)]
    role: Role,
    /// How the runtime polls.
    #[arg(long, value_enum, default_value = "adaptive")]
    polling: Mode,
    /// Message size in bytes (clients).
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// Most ping-pong rounds (after 100 warm-up rounds).
    #[arg(long, default_value_t = 20_000)]
    rounds: usize,
    /// How long a client measures, seconds (ping stops at `rounds` or this, whichever is first).
    #[arg(long, default_value_t = 1.5)]
    seconds: f64,
    /// Rate control: the queueing delay tolerated, microseconds (default: the transport's).
    #[arg(long)]
    target_delay_us: Option<u64>,
    /// The transport's delay-based rate control: on (as in the daemons) or off.
    #[arg(long, default_value = "on", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    rate_control: bool,
    /// Rate control: the starting and highest pacing rate, Gbit/s (default: the transport's).
    #[arg(long)]
    line_rate_gbps: Option<f64>,
    /// Adaptive polling: spin this long after the last work before blocking (default: the
    /// runtime's).
    #[arg(long)]
    spin_us: Option<u64>,
    /// The transport's lower bound on the retransmission timeout, microseconds (default: the
    /// transport's).
    #[arg(long)]
    min_rto_us: Option<u64>,
}

/// The message with index `i`: the index, then bytes derived from it (byte `k` is `i + k`,
/// wrapping).
pub(super) fn fill_message(buf: &mut Vec<u8>, i: u64, size: usize) {
    buf.clear();
    buf.extend_from_slice(&i.to_be_bytes());
    buf.extend_from_slice(message_body(i, size.max(8)));
}

/// Bytes 8.. of message `i` of `size` bytes: a window of a byte ramp, so that making and
/// checking a message are one copy and one comparison (at millions of messages per second the
/// bench's own per-byte loops would weigh as much as a port's per-frame work).
fn message_body(i: u64, size: usize) -> &'static [u8] {
    static RAMP: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let ramp = RAMP.get_or_init(|| (0..256 + 65_536).map(|j| j as u8).collect());
    let start = (i as usize).wrapping_add(8) % 256;
    &ramp[start..start + size.saturating_sub(8).min(65_536)]
}

/// Whether `data` is message `i` (of its length), intact.
pub(super) fn is_message(data: &[u8], i: u64) -> bool {
    index_of(data) == Some(i) && data[8..] == *message_body(i, data.len())
}

pub(super) fn index_of(data: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(data.get(..8)?.try_into().ok()?))
}

// ---------------------------------------------------------------------------------------------
// The peer processes.
// ---------------------------------------------------------------------------------------------

/// Runs one side; the server roles run until stdin closes.
pub fn run_peer(args: PeerArgs) -> anyhow::Result<()> {
    let peer: MacAddr = args.peer.parse().map_err(|e| anyhow!("--peer {:?}: {e:?}", args.peer))?;
    let mut ports = args.port.iter().map(|s| s.open()).collect::<Result<Vec<_>, _>>()?;
    let paths = ports.len();
    let port: Box<dyn lanbus_port::Port> = if paths == 1 {
        ports.remove(0)
    } else {
        Box::new(lanbus_port::MultiPort::new(ports, lanbus_port::MultiConfig::default())?)
    };
    match args.role {
        Role::RawEcho => return raw_echo(port, args.polling),
        Role::RawPing => return raw_ping(port, peer, &args),
        _ => {}
    }
    let mut transport = if args.role == Role::Idle { Config::default() } else { Config::point_to_point() };
    // Frames as large as the link takes (the runtime lowers this to the port's MTU).
    transport.mtu = 65_535;
    transport.rate.enabled = args.rate_control;
    if let Some(us) = args.min_rto_us {
        transport.min_rto = Duration::from_micros(us);
    }
    if paths > 1 {
        // Reordering between paths is not loss (as the daemons set it).
        transport.dup_ack_threshold = lanbus_port::multi::RUN_FRAMES;
    }
    if let Some(g) = args.line_rate_gbps {
        transport.rate.line_rate_bps = (g * 1e9) as u64;
    }
    if let Some(us) = args.target_delay_us {
        transport.rate.target_queue_delay = Duration::from_micros(us);
    }
    let config = RuntimeConfig {
        transport,
        threads: ThreadMode::RunToCompletion,
        polling: match args.polling {
            Mode::Busy => Polling::Busy,
            Mode::Adaptive => match args.spin_us {
                Some(us) => Polling::Adaptive { spin: Duration::from_micros(us) },
                None => Polling::default(),
            },
        },
        name: format!("{:?}", args.role).to_lowercase(),
        ..RuntimeConfig::default()
    };
    match args.role {
        Role::Echo | Role::Sink | Role::Idle => {
            let handler: Box<dyn Handler> = match args.role {
                Role::Echo => Box::new(Echo),
                Role::Sink => Box::new(Sink { next: 0, errors: 0, credit_every: credit_every(args.size) }),
                _ => Box::new(Echo),
            };
            let runtime = Runtime::start(port, config, handler)?;
            println!("ready");
            std::io::stdout().flush()?;
            // Serve until the bench closes our stdin (or dies).
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
            if std::env::var_os("LANBUS_BENCH_VERBOSE").is_some() {
                eprintln!("{:?} server: {:?}", args.role, runtime.stats());
            }
            runtime.shutdown();
            Ok(())
        }
        Role::Ping => ping_client(port, config, peer, &args),
        Role::Stream => stream_client(port, config, peer, &args),
        Role::RawEcho | Role::RawPing => unreachable!("handled before the runtime is set up"),
    }
}

/// Where a raw frame says which message it belongs to, right after the Ethernet header (in the
/// space of the lanbus header it stands in for): the message's number (8 bytes), the frame's
/// index in it and the message's frame count (2 bytes each, big-endian).
const RAW_SEQ: core::ops::Range<usize> = 0..8;
const RAW_INDEX: core::ops::Range<usize> = 8..10;
const RAW_COUNT: core::ops::Range<usize> = 10..12;

fn raw_field(f: &[u8], at: core::ops::Range<usize>) -> Option<&[u8]> {
    f.get(lanbus_wire::ethernet::HEADER_LEN + at.start..lanbus_wire::ethernet::HEADER_LEN + at.end)
}

/// The frame count of the message a raw frame belongs to; 1 for any other frame (the echo bounces
/// those at once, and their bytes say nothing about a count).
fn raw_count(f: &[u8]) -> u16 {
    let raw = f.get(12..14) == Some(&lanbus_wire::ethernet::EtherType::LANBUS_RAW.to_be_bytes()[..]);
    raw_field(f, RAW_COUNT).filter(|_| raw).map_or(1, |b| u16::from_be_bytes([b[0], b[1]]))
}

/// Bounces raw messages back to their sender until stdin closes: a message of one frame at once,
/// one of several frames (a message longer than the link's MTU, see [`raw_ping`]) once all its
/// frames arrived, all of them in one burst, as a receiver that answers whole messages does.
/// Busy: spins on the port without ever yielding (unlike the runtime, which yields every couple
/// of microseconds); adaptive: blocks in the port's `wait` when nothing came.
fn raw_echo(mut port: Box<dyn lanbus_port::Port>, mode: Mode) -> anyhow::Result<()> {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stdin_closed = stop.clone();
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        // Relaxed: only the flag itself is published.
        stdin_closed.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    println!("ready");
    std::io::stdout().flush()?;
    // Frames ready to go back (`ready` of them), then those of the message still arriving.
    let mut frames: Vec<Vec<u8>> = Vec::new();
    let mut ready = 0;
    let mut held = 0;
    let mut held_seq = [0u8; 8];
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        port.rx_burst(32, &mut |f| {
            // Ports deliver whole Ethernet headers; anything shorter is not bounced.
            if f.len() < lanbus_wire::ethernet::HEADER_LEN {
                return;
            }
            let count = usize::from(raw_count(f));
            let seq = raw_field(f, RAW_SEQ).unwrap_or(&[0; 8]);
            if count > 1 && (held == 0 || seq != held_seq) {
                // A new message of several frames; the rest of a message whose frames did not
                // all come is dropped, as its pinger gave up on it.
                held = 0;
                held_seq.copy_from_slice(seq);
            }
            let at = ready + held;
            if frames.len() == at {
                frames.push(Vec::new());
            }
            let back = &mut frames[at];
            back.clear();
            back.extend_from_slice(f);
            back.copy_within(6..12, 0);
            back[6..12].copy_from_slice(&f[0..6]);
            if count <= 1 {
                // Goes back before the frames held.
                frames[ready..=at].rotate_right(1);
                ready += 1;
            } else {
                held += 1;
                if held == count {
                    ready += held;
                    held = 0;
                }
            }
        })?;
        if ready == 0 {
            match mode {
                Mode::Busy => core::hint::spin_loop(),
                Mode::Adaptive => port.wait(Some(Duration::from_millis(5)))?,
            }
            continue;
        }
        let refs: Vec<&[u8]> = frames[..ready].iter().map(|f| f.as_slice()).collect();
        let mut sent = 0;
        while sent < ready {
            sent += port.send_frames(&refs[sent..])?;
        }
        // The frames held move to the front.
        frames[..ready + held].rotate_left(ready);
        ready = 0;
    }
    Ok(())
}

/// The frames a raw round trip sends for a message of `size` bytes on a port whose frames carry
/// `mtu` bytes after the Ethernet header: the lanbus header in each frame, a message record's
/// header and the message spread over as few frames as hold them. Their lengths, Ethernet header
/// included.
pub(crate) fn raw_frame_lengths(size: usize, mtu: usize) -> Vec<usize> {
    use lanbus_wire::ethernet::HEADER_LEN as ETHERNET;
    use lanbus_wire::frame::{HEADER_LEN, RECORD_HEADER_LEN};
    let per_frame = mtu.saturating_sub(HEADER_LEN).max(1);
    let mut left = RECORD_HEADER_LEN + size;
    let mut lengths = Vec::new();
    while left > 0 {
        let n = left.min(per_frame);
        lengths.push(ETHERNET + HEADER_LEN + n);
        left -= n;
    }
    lengths
}

/// Raw round trips against [`raw_echo`]: the frames a lanbus message of `size` bytes takes (one
/// frame of `14 + 32 + 4 + size` bytes, the Ethernet and lanbus headers, a message record's
/// header and the message, or as many full frames as a longer message needs), numbered, sent in
/// one burst, timed from the send to the last frame's return; 100 warm-up rounds, then `rounds`
/// (at least 10) or `seconds` after the warm-up, whichever ends first. Gives up when the port
/// takes no frame or nothing comes back for a second. Prints the same JSON line as the ping
/// client.
fn raw_ping(mut port: Box<dyn lanbus_port::Port>, peer: MacAddr, args: &PeerArgs) -> anyhow::Result<()> {
    use lanbus_wire::ethernet::HEADER_LEN as ETHERNET;
    const WARMUP: usize = 100;
    let lengths = raw_frame_lengths(args.size, port.mtu());
    let count = u16::try_from(lengths.len()).ok().filter(|&c| c < 1024).with_context(|| {
        format!("a {}-byte message takes {} raw frames at MTU {}", args.size, lengths.len(), port.mtu())
    })?;
    let mut frames: Vec<Vec<u8>> = lengths
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let mut f = vec![0u8; len];
            f[0..6].copy_from_slice(&peer.0);
            f[6..12].copy_from_slice(&port.mac().0);
            f[12..14].copy_from_slice(&lanbus_wire::ethernet::EtherType::LANBUS_RAW.to_be_bytes());
            f[ETHERNET + RAW_INDEX.start..ETHERNET + RAW_INDEX.end]
                .copy_from_slice(&(i as u16).to_be_bytes());
            f[ETHERNET + RAW_COUNT.start..ETHERNET + RAW_COUNT.end].copy_from_slice(&count.to_be_bytes());
            f
        })
        .collect();
    let rounds = args.rounds.max(10);
    let mut until = Instant::now();
    let mut samples = Vec::with_capacity(rounds);
    for round in 0u64.. {
        if round == WARMUP as u64 {
            until = Instant::now() + Duration::from_secs_f64(args.seconds);
        }
        let seq = round.to_be_bytes();
        for f in &mut frames {
            f[ETHERNET + RAW_SEQ.start..ETHERNET + RAW_SEQ.end].copy_from_slice(&seq);
        }
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
        let start = Instant::now();
        let mut sent = 0;
        while sent < refs.len() {
            sent += port.send_frames(&refs[sent..])?;
            if sent < refs.len() && start.elapsed() > Duration::from_secs(1) {
                bail!("the port took no frame to send for a second");
            }
        }
        let mut polls = 0u32;
        let mut back = 0;
        loop {
            port.rx_burst(32, &mut |f| {
                back += usize::from(raw_field(f, RAW_SEQ) == Some(&seq[..]) && raw_count(f) == count);
            })?;
            if back >= frames.len() {
                break;
            }
            if args.polling == Mode::Adaptive {
                port.wait(Some(Duration::from_millis(5)))?;
            }
            // A spinning client reads the clock now and then only.
            polls = polls.wrapping_add(1);
            let look = args.polling == Mode::Adaptive || polls.is_multiple_of(1024);
            if look && start.elapsed() > Duration::from_secs(1) {
                bail!("raw message {round} came back from no echo server within 1 s");
            }
        }
        let now = Instant::now();
        if round >= WARMUP as u64 {
            samples.push((now - start).as_secs_f64() * 1e6);
        }
        if samples.len() >= rounds || (round >= WARMUP as u64 && now >= until && samples.len() >= 10) {
            break;
        }
    }
    samples.sort_by(f64::total_cmp);
    let (p50, p99) = (percentile(&samples, 0.5), percentile(&samples, 0.99));
    println!("{}", json!({ "p50_us": p50, "p99_us": p99, "rounds": samples.len(), "frames": frames.len() }));
    Ok(())
}

struct Echo;

impl Handler for Echo {
    fn on_message(&mut self, m: Message<'_>, out: &mut dyn Outbox) {
        out.send(m.peer, m.channel, m.data);
    }
}

/// Messages per credit: about 64 KiB of data.
fn credit_every(size: usize) -> u64 {
    (65_536 / size.max(1)).max(1) as u64
}

/// Counts in-order, intact messages; after the first and then every `credit_every` of them it
/// returns a credit: the count so far and the number of bad messages.
struct Sink {
    next: u64,
    errors: u64,
    credit_every: u64,
}

impl Handler for Sink {
    fn on_message(&mut self, m: Message<'_>, out: &mut dyn Outbox) {
        if !is_message(m.data, self.next) {
            self.errors += 1;
        }
        self.next += 1;
        if self.next == 1 || self.next.is_multiple_of(self.credit_every) {
            let mut credit = [0u8; 16];
            credit[..8].copy_from_slice(&self.next.to_be_bytes());
            credit[8..].copy_from_slice(&self.errors.to_be_bytes());
            out.send(m.peer, m.channel, &credit);
        }
    }
}

/// Ping-pong from the handler: each reply's delivery times the round and sends the next.
struct Pinger {
    peer: MacAddr,
    size: usize,
    sent_at: Instant,
    round: usize,
    warmup: usize,
    rounds: usize,
    until: Instant,
    samples: Vec<f64>,
    buf: Vec<u8>,
    done: Option<mpsc::Sender<Result<Vec<f64>, String>>>,
}

impl Handler for Pinger {
    fn on_message(&mut self, m: Message<'_>, out: &mut dyn Outbox) {
        let now = Instant::now();
        if m.peer != self.peer || m.data.len() != self.size.max(8) || !is_message(m.data, self.round as u64) {
            if let Some(done) = self.done.take() {
                let _ = done.send(Err(format!("round {}: wrong reply", self.round)));
            }
            return;
        }
        if self.round >= self.warmup {
            self.samples.push((now - self.sent_at).as_secs_f64() * 1e6);
        }
        self.round += 1;
        if self.samples.len() >= self.rounds || (now >= self.until && self.samples.len() >= 10) {
            if let Some(done) = self.done.take() {
                let _ = done.send(Ok(std::mem::take(&mut self.samples)));
            }
            return;
        }
        fill_message(&mut self.buf, self.round as u64, self.size);
        self.sent_at = Instant::now();
        out.send(self.peer, CHANNEL, &self.buf);
    }
}

pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// The longest a client waits for its run before giving up.
fn client_deadline(seconds: f64) -> Duration {
    Duration::from_secs_f64(seconds + 30.0)
}

fn ping_client(
    port: Box<dyn lanbus_port::Port>,
    config: RuntimeConfig,
    peer: MacAddr,
    args: &PeerArgs,
) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::channel();
    let warmup = 100;
    let mut first = Vec::new();
    fill_message(&mut first, 0, args.size);
    let pinger = Pinger {
        peer,
        size: args.size,
        sent_at: Instant::now(),
        round: 0,
        warmup,
        rounds: args.rounds.max(10),
        // The warm-up rounds do not count against the time.
        until: Instant::now() + Duration::from_secs_f64(args.seconds + 0.2),
        samples: Vec::with_capacity(args.rounds),
        buf: Vec::new(),
        done: Some(tx),
    };
    let runtime = Runtime::start(port, config, Box::new(pinger))?;
    runtime.sender().send(peer, CHANNEL, &first);
    let result = rx.recv_timeout(client_deadline(args.seconds));
    runtime.shutdown();
    let mut samples = match result {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => bail!("ping-pong failed: {e}"),
        Err(_) => bail!("ping-pong: no reply within {:?}", client_deadline(args.seconds)),
    };
    samples.sort_by(|a, b| a.total_cmp(b));
    let out = json!({
        "rounds": samples.len(),
        "p50_us": percentile(&samples, 0.50),
        "p99_us": percentile(&samples, 0.99),
    });
    println!("{out}");
    Ok(())
}

/// Streams from the handler: each credit tops the window up; after `until` no new messages are
/// sent and the run ends when the credits cover everything sent.
struct Streamer {
    peer: MacAddr,
    size: usize,
    sent: u64,
    window: u64,
    credit_every: u64,
    until: Instant,
    buf: Vec<u8>,
    done: Option<mpsc::Sender<Result<(u64, Instant), String>>>,
    /// When the last credit came, and the longest time between two (the longest gap in
    /// acknowledged data).
    last_credit: Option<Instant>,
    longest_gap: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Handler for Streamer {
    fn on_message(&mut self, m: Message<'_>, out: &mut dyn Outbox) {
        let now = Instant::now();
        let (Some(count), Some(errors)) = (index_of(m.data), m.data.get(8..16)) else {
            return;
        };
        let errors = u64::from_be_bytes(errors.try_into().unwrap_or([0; 8]));
        if let Some(last) = self.last_credit.replace(now) {
            let gap = (now - last).as_nanos() as u64;
            // Relaxed: a maximum read once the stream ended.
            self.longest_gap.fetch_max(gap, std::sync::atomic::Ordering::Relaxed);
        }
        if errors > 0 {
            if let Some(done) = self.done.take() {
                let _ = done.send(Err(format!("the sink saw {errors} bad messages")));
            }
            return;
        }
        if now >= self.until {
            // Stop on a credit boundary so the last credit covers everything sent.
            if count >= self.sent {
                if let Some(done) = self.done.take() {
                    let _ = done.send(Ok((count, now)));
                }
            }
            return;
        }
        // Top up to a credit boundary, so that some credit will match `sent` exactly.
        let target = (count + self.window).next_multiple_of(self.credit_every);
        while self.sent < target {
            fill_message(&mut self.buf, self.sent, self.size);
            out.send(self.peer, CHANNEL, &self.buf);
            self.sent += 1;
        }
    }
}

fn stream_client(
    port: Box<dyn lanbus_port::Port>,
    config: RuntimeConfig,
    peer: MacAddr,
    args: &PeerArgs,
) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::channel();
    let credit_every = credit_every(args.size);
    // About 1 MiB of messages outstanding: many times the bandwidth-delay product of a veth.
    let window = credit_every * 16;
    let start = Instant::now();
    let longest_gap = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let streamer = Streamer {
        peer,
        size: args.size,
        sent: 1,
        window,
        credit_every,
        until: start + Duration::from_secs_f64(args.seconds),
        buf: Vec::new(),
        done: Some(tx),
        last_credit: None,
        longest_gap: longest_gap.clone(),
    };
    let runtime = Runtime::start(port, config, Box::new(streamer))?;
    // Message 0 starts the stream: the sink's first credit follows it, and from then on every
    // message is sent by the handler, in order.
    let mut buf = Vec::new();
    fill_message(&mut buf, 0, args.size);
    runtime.sender().send(peer, CHANNEL, &buf);
    let result = rx.recv_timeout(client_deadline(args.seconds));
    let stats = runtime.stats();
    let paths = runtime.paths();
    runtime.shutdown();
    let (count, end) = match result {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => bail!("streaming failed: {e}"),
        Err(_) => bail!("streaming: no final credit within {:?}", client_deadline(args.seconds)),
    };
    let secs = (end - start).as_secs_f64();
    let msgs_per_s = count as f64 / secs;
    let out = json!({
        "messages": count,
        "seconds": secs,
        "msgs_per_s": msgs_per_s,
        "gbit_per_s": msgs_per_s * args.size as f64 * 8.0 / 1e9,
        "retransmitted_frames": stats.transport.retransmitted_frames,
        "frames_sent": stats.transport.data_frames_sent,
        "timeouts": stats.transport.timeouts,
        "fast_retransmits": stats.transport.fast_retransmits,
        "paced_out": stats.transport.paced_out,
        "rtt_min_us": stats.transport.rtt_min_ns as f64 / 1e3,
        "rtt_mean_us": stats.transport.rtt_mean().map_or(0.0, |d| d.as_secs_f64() * 1e6),
        "rtt_max_us": stats.transport.rtt_max_ns as f64 / 1e3,
        "fabric_rtt_mean_us": stats.transport.fabric_rtt_mean().map_or(0.0, |d| d.as_secs_f64() * 1e6),
        "rate_decreases": stats.transport.rate_decreases,
        "longest_credit_gap_ms": longest_gap.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e6,
        "failovers": paths.iter().map(|p| p.failovers).sum::<u64>(),
        "path_resends": stats.transport.path_resends,
    });
    println!("{out}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::raw_frame_lengths;
    use lanbus_wire::ethernet::HEADER_LEN as ETHERNET;
    use lanbus_wire::frame::{HEADER_LEN, RECORD_HEADER_LEN};

    #[test]
    fn a_raw_message_takes_as_few_frames_as_its_bytes_need() {
        // One frame, as long as the message's lanbus frame.
        assert_eq!(raw_frame_lengths(1024, 1500), vec![ETHERNET + HEADER_LEN + RECORD_HEADER_LEN + 1024]);
        let full = 1500 - HEADER_LEN;
        assert_eq!(raw_frame_lengths(full - RECORD_HEADER_LEN, 1500), vec![ETHERNET + 1500]);
        // One byte more needs a second frame.
        assert_eq!(
            raw_frame_lengths(full - RECORD_HEADER_LEN + 1, 1500),
            vec![ETHERNET + 1500, ETHERNET + HEADER_LEN + 1]
        );
        // Every byte of a 2 KiB message is carried once.
        let l = raw_frame_lengths(2048, 1500);
        assert_eq!(l.len(), 2);
        assert_eq!(l.iter().map(|n| n - ETHERNET - HEADER_LEN).sum::<usize>(), RECORD_HEADER_LEN + 2048);
    }
}
