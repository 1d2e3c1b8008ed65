//! Transport layer: the retransmission timeout from a smoothed RTT (RFC 6298 §2, §5).
//!
//! Invariant: the RTO is always within `[min_rto, max_rto]`, backoff included. Samples come from
//! echoed timestamps, so they are unambiguous even for retransmitted frames (no Karn's rule).

use core::time::Duration;

/// SRTT/RTTVAR state of one channel, in nanoseconds.
#[derive(Debug, Clone)]
pub(crate) struct RttEstimator {
    srtt_ns: u64,
    rttvar_ns: u64,
    has_sample: bool,
    initial_ns: u64,
    min_ns: u64,
    max_ns: u64,
    /// Number of consecutive timeouts: the RTO is doubled this many times.
    backoff: u32,
}

/// Clock granularity G of RFC 6298: our clock is nanoseconds, but RTTs are measured across two
/// machines' software stacks; 1 µs keeps RTTVAR from collapsing the RTO onto SRTT.
const GRANULARITY_NS: u64 = 1_000;

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl RttEstimator {
    pub(crate) fn new(initial: Duration, min: Duration, max: Duration) -> Self {
        let min_ns = ns(min);
        let max_ns = ns(max).max(min_ns);
        RttEstimator {
            srtt_ns: 0,
            rttvar_ns: 0,
            has_sample: false,
            initial_ns: ns(initial).clamp(min_ns, max_ns),
            min_ns,
            max_ns,
            backoff: 0,
        }
    }

    /// RFC 6298 §2.2 (first sample) and §2.3 (later ones), with alpha = 1/8, beta = 1/4.
    pub(crate) fn on_sample(&mut self, rtt_ns: u64) {
        if !self.has_sample {
            self.srtt_ns = rtt_ns;
            self.rttvar_ns = rtt_ns / 2;
            self.has_sample = true;
        } else {
            let err = self.srtt_ns.abs_diff(rtt_ns);
            self.rttvar_ns = (3 * self.rttvar_ns + err) / 4;
            self.srtt_ns = (7 * self.srtt_ns + rtt_ns) / 8;
        }
    }

    /// New data was acknowledged: the backoff ends (RFC 6298 §5.7's recomputation).
    pub(crate) fn on_progress(&mut self) {
        self.backoff = 0;
    }

    /// The timer expired: double the RTO (§5.5), up to the bound.
    pub(crate) fn on_timeout(&mut self) {
        self.backoff = self.backoff.saturating_add(1).min(32);
    }

    /// The smoothed RTT, if measured.
    pub(crate) fn srtt(&self) -> Option<u64> {
        self.has_sample.then_some(self.srtt_ns)
    }

    /// `srtt + 4 * rttvar` without the RTO's bounds or backoff: how long an answer may take
    /// given the round trips' variation so far.
    pub(crate) fn variation_bound(&self) -> Option<u64> {
        self.has_sample.then(|| self.srtt_ns.saturating_add(4 * self.rttvar_ns))
    }

    /// The current RTO with backoff, within the bounds.
    pub(crate) fn rto(&self) -> Duration {
        let base = if self.has_sample {
            self.srtt_ns.saturating_add((4 * self.rttvar_ns).max(GRANULARITY_NS))
        } else {
            self.initial_ns
        };
        let base = base.clamp(self.min_ns, self.max_ns);
        let backed = base.checked_shl(self.backoff).filter(|v| v >> self.backoff == base).unwrap_or(u64::MAX);
        Duration::from_nanos(backed.min(self.max_ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn follows_rfc6298() {
        let mut r = RttEstimator::new(us(1000), us(100), us(100_000));
        assert_eq!(r.rto(), us(1000));
        r.on_sample(200_000); // 200 us: SRTT 200, RTTVAR 100, RTO 600
        assert_eq!(r.rto(), us(600));
        r.on_sample(200_000); // RTTVAR 75, SRTT 200, RTO 500
        assert_eq!(r.rto(), us(500));
    }

    #[test]
    fn bounds_and_backoff() {
        let mut r = RttEstimator::new(us(1000), us(100), us(3000));
        r.on_sample(10_000); // 10 us: RTO would be 30 us, bounded to 100 us
        assert_eq!(r.rto(), us(100));
        let mut seen = vec![];
        for _ in 0..8 {
            r.on_timeout();
            seen.push(r.rto());
        }
        assert_eq!(seen, vec![us(200), us(400), us(800), us(1600), us(3000), us(3000), us(3000), us(3000)]);
        for _ in 0..100 {
            r.on_timeout();
        }
        assert_eq!(r.rto(), us(3000));
        r.on_progress();
        assert_eq!(r.rto(), us(100));
    }
}
