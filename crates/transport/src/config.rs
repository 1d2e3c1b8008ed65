//! Transport layer: settings. Defaults suit a 10 Gbit/s LAN with RTTs of a few to a few tens of
//! microseconds (one switch hop), as in the ExpressEther papers.

use core::time::Duration;

use lanbus_wire::frame::Role;

/// Delay-based rate control (Timely/Swift spirit) and pacing of one channel.
#[derive(Debug, Clone, PartialEq)]
pub struct RateConfig {
    /// Whether channels are paced at all. Off: frames go out as fast as the window allows.
    pub enabled: bool,
    /// The starting and highest pacing rate, bits per second: the access link's rate where it is
    /// known (the simulator sets its links'); by default 100 Gbit/s, beyond what a software
    /// endpoint sends, so that only measured delay sets the pace.
    pub line_rate_bps: u64,
    /// The lowest pacing rate, bits per second.
    pub min_rate_bps: u64,
    /// Queueing delay tolerated above the minimum RTT before the rate is cut; a channel also
    /// keeps at most `rate * (min RTT + this + the hosts' smoothed share of the RTT)` bytes in
    /// flight. The default, 25 µs, is a fifth
    /// of a 128 KiB switch buffer at 10 Gbit/s, and above what a busy host adds to a round trip
    /// once both ends leave out their own waits (the port's receive timestamps): a port sends
    /// frames in bursts, whose last frame waits for the others, and threads share cores.
    pub target_queue_delay: Duration,
    /// Rate added once per RTT while the delay is below target, bits per second.
    pub additive_increase_bps: u64,
    /// Multiplicative-decrease gain: the rate is multiplied by `1 - beta * (rtt - target) / rtt`.
    pub beta: f64,
    /// The largest cut in one step (0.5 = halve at most), also applied on a timeout.
    pub max_decrease: f64,
}

impl Default for RateConfig {
    fn default() -> Self {
        RateConfig {
            enabled: true,
            line_rate_bps: 100_000_000_000,
            min_rate_bps: 50_000_000,
            target_queue_delay: Duration::from_micros(25),
            additive_increase_bps: 250_000_000,
            beta: 0.8,
            max_decrease: 0.5,
        }
    }
}

/// Heartbeats and the peer table.
#[derive(Debug, Clone, PartialEq)]
pub struct HeartbeatConfig {
    /// Whether to announce ourselves and keep a peer table. Off: no heartbeats are sent, any peer
    /// may exchange DATA/ACK frames (the group rule still applies), and no events are produced.
    pub enabled: bool,
    /// How often to broadcast a heartbeat.
    pub interval: Duration,
    /// A peer is down after this many of its announced intervals with no frame at all from it
    /// (any valid DATA, ACK or heartbeat frame counts).
    pub missed_limit: u32,
    /// Our role.
    pub role: Role,
    /// Our name (cut to 64 bytes on the wire).
    pub name: String,
}

impl Default for HeartbeatConfig {
    fn default() -> Self {
        HeartbeatConfig {
            enabled: true,
            interval: Duration::from_millis(100),
            missed_limit: 3,
            role: Role::Host,
            name: String::from("lanbus"),
        }
    }
}

/// The retransmission paper's fast-retransmit rule in [`Config::dup_ack_threshold`]'s counting:
/// two ACKs with the same number in a row, that is one duplicate.
pub const PAPER_DUP_ACK_THRESHOLD: u32 = 1;

/// Everything an [`Endpoint`](crate::Endpoint) needs to know. Build with `Config::default()` and
/// change fields.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Ethernet payload bytes per frame (lanbus header + payload), as an interface MTU. At least
    /// 64; the Ethernet frame is 14 bytes longer.
    pub mtu: usize,
    /// Frames that may be in flight per channel beyond the oldest unacknowledged one. The default
    /// (128) is many times the bandwidth-delay product of a 10 Gbit/s LAN hop even for small
    /// frames; a bigger window buys no throughput there, and Go-Back-N resends it all per loss.
    pub window_frames: u32,
    /// Frames (sent-unacknowledged plus queued) a channel holds before `send` says `QueueFull`.
    pub send_queue_frames: usize,
    /// Selective repeat: the receiver holds frames that arrive past a hole (up to 256 frames,
    /// within the receive backlog) and its ACKs say which ones it holds; the sender resends only
    /// the frames found lost (a frame sent no earlier than a lost one was acknowledged past it).
    /// Off: Go-Back-N, the retransmission paper's scheme (the receiver drops every frame after a
    /// hole and the sender resends the window from it). Each side's setting governs its own half,
    /// and either works with the other.
    pub selective_repeat: bool,
    /// Duplicate ACKs (ACKs that acknowledge nothing new) that trigger a fast retransmit; with
    /// selective repeat, frames acknowledged past a hole before it counts as lost (fewer if fewer
    /// were sent after it). The retransmission paper's rule, two ACKs with the same number in a
    /// row, is [`PAPER_DUP_ACK_THRESHOLD`]: the second of the two is the first duplicate.
    pub dup_ack_threshold: u32,
    /// Retransmission timeout before the first RTT sample.
    pub initial_rto: Duration,
    /// Lower bound of the RTO.
    pub min_rto: Duration,
    /// Send the oldest unacknowledged frame once more when no ACK came for two smoothed round
    /// trips plus the ACK delay (or the smoothed round trip plus four times its variation, if
    /// longer) while frames are in flight (a tail-loss probe, as TCP's RACK-TLP): a lost last frame, which no later frame reveals through duplicate ACKs, then
    /// costs a few round trips instead of a retransmission timeout. One probe per flight (until
    /// the next ACK progress); the RTO still backs it up. Off in the simulator's
    /// reproduction of the retransmission paper, whose scheme has no probe.
    pub tail_loss_probe: bool,
    /// Upper bound of the RTO, backoff included.
    pub max_rto: Duration,
    /// Acknowledge after this many in-order frames...
    pub ack_every_frames: u32,
    /// ...or this long after the first unacknowledged one, whichever comes first.
    pub ack_delay: Duration,
    /// Pack several small messages into one frame.
    pub pack_messages: bool,
    /// Checksum every frame sent, and drop received frames without a correct one.
    pub checksum: bool,
    /// The first sequence number of every new channel (tests start near the wrap).
    pub initial_sequence: u32,
    /// Our group; DATA/ACK frames from other groups are dropped.
    pub group: u16,
    /// This incarnation's epoch, carried by every frame; a driver draws a new one each time the
    /// endpoint starts (the runtime does when this is 0), so that peers tell a restart from the
    /// incarnation before it. 0 here in a sans-IO endpoint means 1.
    pub epoch: u32,
    /// Receive channels (peer, channel) kept at most; frames opening more are dropped.
    pub max_channels: usize,
    /// Received bytes waiting in `poll_message` before new DATA frames are dropped (unacknowledged,
    /// so the sender retries): the receiver's flow control.
    pub max_receive_backlog_bytes: usize,
    /// Rate control and pacing.
    pub rate: RateConfig,
    /// Heartbeats.
    pub heartbeat: HeartbeatConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            mtu: 1500,
            window_frames: 128,
            send_queue_frames: 1024,
            selective_repeat: true,
            dup_ack_threshold: 2,
            initial_rto: Duration::from_millis(1),
            min_rto: Duration::from_micros(100),
            tail_loss_probe: true,
            max_rto: Duration::from_millis(100),
            ack_every_frames: 4,
            ack_delay: Duration::from_micros(5),
            pack_messages: true,
            checksum: true,
            initial_sequence: 0,
            group: 0,
            epoch: 0,
            max_channels: 4096,
            max_receive_backlog_bytes: 16 << 20,
            rate: RateConfig::default(),
            heartbeat: HeartbeatConfig::default(),
        }
    }
}

impl Config {
    /// The default settings without heartbeats: two endpoints that know each other's MAC.
    pub fn point_to_point() -> Self {
        let mut c = Config::default();
        c.heartbeat.enabled = false;
        c
    }

    /// Largest payload (message records) one frame carries.
    pub(crate) fn max_payload(&self) -> usize {
        self.mtu.clamp(64, 65_535) - lanbus_wire::frame::HEADER_LEN
    }

    /// The longest message that travels in a single frame of its own (its record alone in the
    /// payload). A receiver takes such a message straight from the frame; a longer one is
    /// reassembled from its fragments in a buffer first.
    pub fn max_single_frame_message(&self) -> usize {
        self.max_payload() - lanbus_wire::frame::RECORD_HEADER_LEN
    }

    /// Bytes of the largest Ethernet frame this endpoint writes: the size of the buffer
    /// `poll_transmit` needs.
    pub fn frame_capacity(&self) -> usize {
        lanbus_wire::ethernet::HEADER_LEN + self.mtu.clamp(64, 65_535)
    }
}
