//! Transport layer: delay-based rate control and pacing of one channel (in the spirit of Timely and Swift).
//!
//! The RTT here is the fabric's: the sender's sample less the time the two hosts report they
//! held the frame and its ACK (coalescing, their threads waiting for a core), which is no queue on
//! the wire. That RTT minus the smallest seen is taken as the queueing delay, and the delay
//! tolerated is `target_queue_delay` plus the hosts' smoothed share of the round trip: the
//! threshold is `min_rtt + target + host`. The hosts' share widens it because their own waits
//! leak into the fabric's share by as much: a frame is stamped before its thread hands it to the
//! kernel, and a software path (a veth, a Linux bridge) forwards it in the kernel's softirq work,
//! which waits for a core like any thread. On a loaded two-core host the fabric's share of an
//! uncongested round trip swings by a hundred microseconds with the load while the hosts' share
//! is ten times that; a fixed 25 µs target read that as queueing and cut four streams on a
//! software switch to a fifth of their rate. Where the hosts are quick (a simulated or hardware
//! fabric, whose hosts hold a frame for microseconds) the threshold is the target's.
//!
//! Above the threshold the rate is multiplied by `1 - beta * (rtt - threshold) / rtt` (at most
//! once per smoothed RTT, never by less than `1 - max_decrease`); at or below it the rate grows
//! by `additive_increase_bps` once per smoothed RTT. A timeout cuts by `max_decrease`. While the
//! RTT is above the threshold but falling clearly (its smoothed sample-to-sample difference below
//! −min_rtt/100, Timely's gradient), the rate holds: the queue is draining and a cut would land
//! after it is gone. A flow also keeps at most what its rate moves in a round trip at the
//! threshold in flight, `rate * (threshold + host)` (Swift's window over the whole round trip the
//! ACK clock ticks at), so a growing queue slows it through the ACK clock at once.
//! Pacing, as in Swift, only while that window is below one frame (a flow cut that far would
//! otherwise still send a frame per round trip): each frame of `n` bytes moves the earliest next
//! send time `n * 8 / rate` later; one frame of slack is kept so a driver that polls a little
//! late does not lose rate. Above one frame the ACKs clock the flow. Pacing every flow at its
//! rate makes things worse where many bursts share a port: a flow cut while it competed starts
//! its next burst paced at that rate, bursts last longer and meet more often, and in the
//! simulator at 64 hosts the port collapsed from 40% utilisation (mean burst ratio 0.02 at 60%)
//! where the window alone keeps it above no control at every load.
//!
//! Invariant: `min_rate <= rate <= line_rate`.

use core::time::Duration;

use lanbus_wire::Instant;

use crate::config::RateConfig;

#[derive(Debug, Clone)]
pub(crate) struct RateControl {
    enabled: bool,
    /// The frame size below whose window pacing applies (the transport's MTU).
    frame_bytes: usize,
    /// `target_queue_delay`, ns.
    target_ns: u64,
    rate_bps: f64,
    min_rtt_ns: u64,
    last_decrease: Option<Instant>,
    last_increase: Option<Instant>,
    next_send: Instant,
    prev_rtt_ns: Option<u64>,
    /// Smoothed difference between consecutive RTT samples, ns: positive while the queue grows.
    rtt_diff_ns: f64,
    /// Smoothed time the two hosts held a frame and its ACK, ns (gain 1/8, as a smoothed RTT).
    host_ns: f64,
    /// The smallest fabric RTT of the previous and of the current interval of half a smoothed
    /// RTT, ns: their minimum is the standing RTT.
    interval_min_ns: [u64; 2],
    /// When the current interval began.
    interval_start: Option<Instant>,
}

impl RateControl {
    pub(crate) fn new(cfg: &RateConfig, frame_bytes: usize) -> Self {
        RateControl {
            enabled: cfg.enabled,
            frame_bytes,
            target_ns: cfg.target_queue_delay.as_nanos() as u64,
            rate_bps: cfg.line_rate_bps.max(1) as f64,
            min_rtt_ns: u64::MAX,
            last_decrease: None,
            last_increase: None,
            next_send: Instant::ZERO,
            prev_rtt_ns: None,
            rtt_diff_ns: 0.0,
            host_ns: 0.0,
            interval_min_ns: [u64::MAX; 2],
            interval_start: None,
        }
    }

    /// The current pacing rate, bits per second.
    pub(crate) fn rate_bps(&self) -> f64 {
        self.rate_bps
    }

    /// Whether rate control is on for this flow.
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// The fabric's share of the RTT above which the rate is cut: `min_rtt + target + host`, ns.
    fn threshold_ns(&self) -> f64 {
        let min_rtt = if self.min_rtt_ns == u64::MAX { 0 } else { self.min_rtt_ns };
        min_rtt.saturating_add(self.target_ns) as f64 + self.host_ns
    }

    /// The bytes a flow keeps in flight: `rate * (threshold + host)`, what the rate moves in a
    /// whole round trip whose fabric share is at the threshold.
    fn window_bytes(&self) -> f64 {
        self.rate_bps / 8.0 * (self.threshold_ns() + self.host_ns) / 1e9
    }

    /// Whether frames are paced now: rate control on and the window below one frame.
    fn pacing(&self) -> bool {
        self.enabled && self.window_bytes() < self.frame_bytes as f64
    }

    /// When the next frame may leave (`None` when nothing is paced).
    pub(crate) fn next_send(&self) -> Option<Instant> {
        self.pacing().then_some(self.next_send)
    }

    /// Whether a frame of `frame_bytes` may join `inflight_bytes` already in flight: a flow
    /// keeps at most `rate * (threshold + host)` in flight (Swift's window, over the whole
    /// round trip the ACK clock ticks at), so when
    /// a queue builds the ACK clock slows it at once, before any rate cut can take effect. At
    /// least one frame is always allowed.
    pub(crate) fn window_allows(&self, inflight_bytes: usize, frame_bytes: usize) -> bool {
        if !self.enabled || inflight_bytes == 0 {
            return true;
        }
        (inflight_bytes + frame_bytes) as f64 <= self.window_bytes()
    }

    pub(crate) fn may_send(&self, now: Instant) -> bool {
        !self.pacing() || self.next_send <= now
    }

    pub(crate) fn on_send(&mut self, now: Instant, bytes: usize) {
        if !self.enabled {
            return;
        }
        let gap = Duration::from_nanos((bytes as f64 * 8.0 * 1e9 / self.rate_bps) as u64);
        let floor = Instant::from_nanos(now.as_nanos().saturating_sub(gap.as_nanos() as u64));
        self.next_send = self.next_send.max(floor) + gap;
    }

    fn clamp(&mut self, cfg: &RateConfig) {
        let max = cfg.line_rate_bps.max(1) as f64;
        let min = (cfg.min_rate_bps as f64).min(max);
        self.rate_bps = self.rate_bps.clamp(min, max);
    }

    /// Takes one RTT sample: `rtt_ns` the fabric's share, `host_ns` the time the two hosts held
    /// the frame and its ACK. Returns whether the rate was cut.
    pub(crate) fn on_rtt(
        &mut self,
        cfg: &RateConfig,
        now: Instant,
        rtt_ns: u64,
        host_ns: u64,
        srtt_ns: u64,
    ) -> bool {
        if !self.enabled {
            return false;
        }
        self.host_ns += (host_ns as f64 - self.host_ns) / 8.0;
        self.min_rtt_ns = self.min_rtt_ns.min(rtt_ns);
        let standing = self.standing(now, rtt_ns, srtt_ns);
        let threshold = self.threshold_ns() as u64;
        let once_per_rtt =
            |last: Option<Instant>| last.is_none_or(|t| now - t >= Duration::from_nanos(srtt_ns));
        if let Some(prev) = self.prev_rtt_ns {
            let diff = rtt_ns as f64 - prev as f64;
            self.rtt_diff_ns = 0.75 * self.rtt_diff_ns + 0.25 * diff;
        }
        self.prev_rtt_ns = Some(rtt_ns);
        let falling = self.rtt_diff_ns < -(self.min_rtt_ns as f64 / 100.0);
        let mut cut = false;
        if standing > threshold && falling {
            // Above the threshold but the queue is draining (Timely's gradient): a cut now would land
            // after the queue is gone and leave the link idle. Hold.
        } else if standing > threshold {
            if once_per_rtt(self.last_decrease) {
                let over = (standing - threshold) as f64 / standing as f64;
                let factor = (1.0 - cfg.beta * over).max(1.0 - cfg.max_decrease);
                self.rate_bps *= factor;
                self.last_decrease = Some(now);
                cut = true;
            }
        } else if once_per_rtt(self.last_increase) {
            self.rate_bps += cfg.additive_increase_bps as f64;
            self.last_increase = Some(now);
        }
        self.clamp(cfg);
        cut
    }

    /// The standing RTT after the sample `rtt_ns` (Copa's): the smallest sample of the last half
    /// to whole smoothed RTT. A queue raises every sample while it stands; a host's hiccup (a
    /// thread or the kernel's softirq work waiting for a core, a burst's last frame waiting for
    /// the others) raises some, and is not read as a queue. A flow with one sample per round
    /// trip or fewer is judged by each sample.
    fn standing(&mut self, now: Instant, rtt_ns: u64, srtt_ns: u64) -> u64 {
        let half = Duration::from_nanos(srtt_ns / 2);
        match self.interval_start {
            Some(start) if now - start < half => {
                self.interval_min_ns[1] = self.interval_min_ns[1].min(rtt_ns);
            }
            Some(start) if now - start < half * 2 => {
                self.interval_min_ns = [self.interval_min_ns[1], rtt_ns];
                self.interval_start = Some(now);
            }
            _ => {
                self.interval_min_ns = [u64::MAX, rtt_ns];
                self.interval_start = Some(now);
            }
        }
        self.interval_min_ns[0].min(self.interval_min_ns[1])
    }

    /// A retransmission timeout: cuts the rate by `max_decrease`. Returns whether it did (rate
    /// control on).
    pub(crate) fn on_timeout(&mut self, cfg: &RateConfig, now: Instant) -> bool {
        if !self.enabled {
            return false;
        }
        self.rate_bps *= 1.0 - cfg.max_decrease;
        self.last_decrease = Some(now);
        self.clamp(cfg);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(us: u64) -> Instant {
        Instant::from_nanos(us * 1000)
    }

    /// A 10 Gbit/s access link and a 10 µs target.
    fn ten_gig() -> RateConfig {
        RateConfig {
            line_rate_bps: 10_000_000_000,
            target_queue_delay: Duration::from_micros(10),
            ..RateConfig::default()
        }
    }

    #[test]
    fn decreases_above_target_and_increases_below() {
        let cfg = ten_gig();
        let mut r = RateControl::new(&cfg, 1500);
        r.on_rtt(&cfg, t(0), 10_000, 0, 10_000);
        assert_eq!(r.rate_bps(), 10e9, "at line rate already");
        // 100 us RTT, two round trips later: target 20 us, over = 0.8, factor = 1 - 0.64 ->
        // limited to 0.5.
        r.on_rtt(&cfg, t(20), 100_000, 0, 10_000);
        assert_eq!(r.rate_bps(), 5e9);
        // Within the same RTT: no second cut.
        r.on_rtt(&cfg, t(21), 100_000, 0, 10_000);
        assert_eq!(r.rate_bps(), 5e9);
        // 20 us later the RTT is still above target but falling (the queue drains): hold.
        r.on_rtt(&cfg, t(42), 35_000, 0, 10_000);
        assert_eq!(r.rate_bps(), 5e9);
        // Still falling a little (45 after 35 and 100...): hold; rising again: cut by the
        // standing RTT, the smallest of the last half to whole round trip (45 us),
        // 1 - 0.8 * (45 - 20) / 45, once per RTT.
        r.on_rtt(&cfg, t(60), 45_000, 0, 10_000);
        assert_eq!(r.rate_bps(), 5e9);
        r.on_rtt(&cfg, t(61), 46_000, 0, 10_000);
        r.on_rtt(&cfg, t(62), 47_000, 0, 10_000);
        assert!((r.rate_bps() - 5e9 * (1.0 - 0.8 * 25.0 / 45.0)).abs() < 1.0, "{}", r.rate_bps());
        // Below target: additive increase, once per RTT.
        let before = r.rate_bps();
        r.on_rtt(&cfg, t(80), 12_000, 0, 10_000);
        r.on_rtt(&cfg, t(81), 12_000, 0, 10_000);
        assert_eq!(r.rate_bps(), before + 250e6);
        for i in 0..1000 {
            r.on_timeout(&cfg, t(100 + i));
        }
        assert_eq!(r.rate_bps(), 50e6, "bounded below");
    }

    #[test]
    fn one_late_sample_among_quick_ones_is_no_queue() {
        // Samples every 2 us, a 20 us round trip: a sample of 90 us (a host's hiccup) among
        // samples of 10 us is no standing queue; 90 us for a whole round trip is.
        let cfg = ten_gig();
        let mut r = RateControl::new(&cfg, 1500);
        for i in 0..20 {
            r.on_rtt(&cfg, t(2 * i), 10_000, 0, 20_000);
        }
        r.on_rtt(&cfg, t(40), 90_000, 0, 20_000);
        r.on_rtt(&cfg, t(42), 10_000, 0, 20_000);
        assert_eq!(r.rate_bps(), 10e9, "a hiccup");
        for i in 0..20 {
            r.on_rtt(&cfg, t(44 + 2 * i), 90_000, 0, 20_000);
        }
        assert!(r.rate_bps() < 10e9, "a queue");
    }

    #[test]
    fn keeps_rate_times_horizon_in_flight() {
        let cfg = ten_gig();
        let mut r = RateControl::new(&cfg, 1500);
        // Before any sample the horizon is the target delay: 10 Gbit/s * 10 us = 12500 bytes.
        assert!(r.window_allows(0, 100_000), "one frame always goes");
        assert!(r.window_allows(11_000, 1500));
        assert!(!r.window_allows(11_001, 1500));
        r.on_rtt(&cfg, t(0), 10_000, 0, 10_000); // min RTT 10 us: 25000 bytes
        assert!(r.window_allows(23_500, 1500) && !r.window_allows(23_501, 1500));
        let off = RateControl::new(&RateConfig { enabled: false, ..cfg }, 1500);
        assert!(off.window_allows(usize::MAX / 2, 1500));
    }

    #[test]
    fn the_window_covers_the_hosts_share_of_the_round_trip() {
        // Hosts that hold every frame and ACK 80 us between them: the ACK clock ticks every
        // 90 us, and a window of the fabric's 10 us + 10 us target would hold the flow to 2/9 of
        // its rate with no queue anywhere. The threshold grows toward 10 + 10 + 80 us and the
        // window toward the rate times that plus the hosts' 80 us.
        let cfg = ten_gig();
        let mut r = RateControl::new(&cfg, 1500);
        for i in 0..100 {
            r.on_rtt(&cfg, t(i), 10_000, 80_000, 90_000);
        }
        assert_eq!(r.rate_bps(), 10e9, "the host's share is no queue: no cut");
        assert!((r.threshold_ns() - 100_000.0).abs() < 10.0, "{}", r.threshold_ns());
        let window = r.window_bytes();
        assert!((window - 225_000.0).abs() < 100.0, "{window}");
        // A fabric share of 60 us is within the wider threshold: no cut.
        r.on_rtt(&cfg, t(200), 60_000, 80_000, 90_000);
        assert_eq!(r.rate_bps(), 10e9);
        // The hosts' share shrinks again when they get quicker, and with it the threshold: the
        // same 60 us is now queueing.
        for i in 300..400 {
            r.on_rtt(&cfg, t(i), 10_000, 0, 10_000);
        }
        assert!((r.window_bytes() - 25_000.0).abs() < 100.0, "{}", r.window_bytes());
        r.on_rtt(&cfg, t(500), 60_000, 0, 10_000);
        assert!(r.rate_bps() < 10e9, "cut");
    }

    #[test]
    fn paces_frames_only_while_the_window_is_below_one_frame() {
        // 1 Gbit/s with the 25 us target: a window of 3125 bytes, two 1500-byte frames; the ACKs
        // clock such a flow, nothing waits for a pacing time.
        let cfg = RateConfig { line_rate_bps: 1_000_000_000, ..RateConfig::default() };
        let mut clocked = RateControl::new(&cfg, 1500);
        clocked.on_send(t(0), 1500);
        assert!(clocked.may_send(t(0)) && clocked.next_send().is_none());
        // With 9000-byte frames the window is below one: paced, 1000 bytes taking 8 us.
        let mut r = RateControl::new(&cfg, 9000);
        assert!(r.may_send(t(0)));
        r.on_send(t(0), 1000);
        assert_eq!(r.next_send(), Some(t(8)));
        assert!(!r.may_send(t(7)));
        r.on_send(t(8), 1000);
        assert_eq!(r.next_send(), Some(t(16)));
        // Late by 100 us: one frame of slack, not 12.
        r.on_send(t(116), 1000);
        assert_eq!(r.next_send(), Some(t(116)));
        let off = RateControl::new(&RateConfig { enabled: false, ..cfg }, 9000);
        assert!(off.may_send(t(0)) && off.next_send().is_none());
    }
}
