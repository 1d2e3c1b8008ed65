//! Traffic generators: when an application offers how many bytes.
//!
//! Layer: simulation helpers. A generator is an iterator of [`Arrival`]s in non-decreasing time.
//! Generators are deterministic: the random ones take their own seed, so adding a generator to a
//! run does not disturb the other random decisions.

use core::time::Duration;

use lanbus_wire::Instant;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// An application offering `bytes` at `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    /// When the bytes are offered.
    pub at: Instant,
    /// How many.
    pub bytes: usize,
}

/// Messages of a fixed size at a constant bit rate: the k-th at `start + k * size * 8 / rate`
/// (computed exactly, so there is no drift), `count` of them.
#[derive(Debug, Clone)]
pub struct ConstantRate {
    start: Instant,
    message_bytes: usize,
    rate_bps: u64,
    next: u64,
    count: u64,
}

impl ConstantRate {
    /// `count` messages of `message_bytes` offered at `rate_bps` from `start`.
    pub fn new(start: Instant, message_bytes: usize, rate_bps: u64, count: u64) -> Self {
        ConstantRate { start, message_bytes, rate_bps: rate_bps.max(1), next: 0, count }
    }
}

impl Iterator for ConstantRate {
    type Item = Arrival;
    fn next(&mut self) -> Option<Arrival> {
        if self.next == self.count {
            return None;
        }
        let bits = u128::from(self.next) * self.message_bytes as u128 * 8;
        let ns = bits * 1_000_000_000 / u128::from(self.rate_bps);
        self.next += 1;
        Some(Arrival {
            at: self.start + Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX)),
            bytes: self.message_bytes,
        })
    }
}

/// Draws an exponentially distributed duration with the given mean (inverse transform).
pub fn exponential(rng: &mut impl Rng, mean: Duration) -> Duration {
    let u: f64 = rng.random::<f64>();
    // 1 - u is in (0, 1], so the logarithm is finite.
    Duration::from_secs_f64(-(1.0 - u).ln() * mean.as_secs_f64())
}

/// Bursts of a fixed size whose start times form a Poisson process (exponential gaps between
/// burst starts, mean `mean_gap`), until `stop`. The paper's multi-session workload: 1 MB bursts,
/// mean gap 11.4 ms, i.e. 0.7 Gbit/s on average.
#[derive(Debug, Clone)]
pub struct PoissonBursts {
    rng: ChaCha8Rng,
    at: Instant,
    burst_bytes: usize,
    mean_gap: Duration,
    stop: Instant,
}

impl PoissonBursts {
    /// Bursts of `burst_bytes` from `start` (the first one gap after it) until `stop`.
    pub fn new(seed: u64, start: Instant, burst_bytes: usize, mean_gap: Duration, stop: Instant) -> Self {
        PoissonBursts { rng: ChaCha8Rng::seed_from_u64(seed), at: start, burst_bytes, mean_gap, stop }
    }
}

impl Iterator for PoissonBursts {
    type Item = Arrival;
    fn next(&mut self) -> Option<Arrival> {
        self.at += exponential(&mut self.rng, self.mean_gap);
        (self.at < self.stop).then_some(Arrival { at: self.at, bytes: self.burst_bytes })
    }
}

/// An on/off source: exponentially distributed on and off periods; while on, messages of a fixed
/// size at `rate_bps`.
#[derive(Debug, Clone)]
pub struct OnOff {
    rng: ChaCha8Rng,
    at: Instant,
    on_until: Instant,
    mean_on: Duration,
    mean_off: Duration,
    message_bytes: usize,
    rate_bps: u64,
    stop: Instant,
}

impl OnOff {
    /// Starts with an off period at `start`.
    pub fn new(
        seed: u64,
        start: Instant,
        mean_on: Duration,
        mean_off: Duration,
        message_bytes: usize,
        rate_bps: u64,
        stop: Instant,
    ) -> Self {
        OnOff {
            rng: ChaCha8Rng::seed_from_u64(seed),
            at: start,
            on_until: start,
            mean_on,
            mean_off,
            message_bytes,
            rate_bps: rate_bps.max(1),
            stop,
        }
    }
}

impl Iterator for OnOff {
    type Item = Arrival;
    fn next(&mut self) -> Option<Arrival> {
        let gap = lanbus_port::sim::serialisation(self.message_bytes, self.rate_bps);
        if self.at + gap > self.on_until {
            let off = exponential(&mut self.rng, self.mean_off);
            self.at = self.on_until + off;
            self.on_until = self.at + exponential(&mut self.rng, self.mean_on);
        } else {
            self.at += gap;
        }
        (self.at < self.stop).then_some(Arrival { at: self.at, bytes: self.message_bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_rate_is_exact() {
        let v: Vec<_> = ConstantRate::new(Instant::ZERO, 125, 1_000_000_000, 3).collect();
        let times: Vec<u64> = v.iter().map(|a| a.at.as_nanos()).collect();
        assert_eq!(times, [0, 1000, 2000]);
    }

    #[test]
    fn poisson_bursts_have_the_mean_rate() {
        let stop = Instant::ZERO + Duration::from_secs(100);
        let mean = Duration::from_micros(11_400);
        let n = PoissonBursts::new(1, Instant::ZERO, 1_000_000, mean, stop).count() as f64;
        let expect = 100.0 / 0.0114;
        assert!((n - expect).abs() < expect * 0.03, "{n} vs {expect}");
    }

    #[test]
    fn on_off_duty_cycle() {
        let stop = Instant::ZERO + Duration::from_secs(10);
        let ms = Duration::from_millis(1);
        let n = OnOff::new(2, Instant::ZERO, ms, ms * 3, 1250, 1_000_000_000, stop).count() as f64;
        // On a quarter of the time at 100k messages/s.
        let expect = 10.0 * 100_000.0 / 4.0;
        assert!((n - expect).abs() < expect * 0.05, "{n} vs {expect}");
    }
}
