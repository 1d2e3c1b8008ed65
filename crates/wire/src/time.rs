//! Logical time for sans-IO cores.
//!
//! Cores never read a clock: drivers pass an [`Instant`] into every `handle_*` call. An `Instant`
//! is a count of nanoseconds since an arbitrary origin chosen by the driver (process start for the
//! real daemon, zero for the simulator), so simulated and real runs use the same arithmetic.
//! Spans are plain [`core::time::Duration`]s.

use core::ops::{Add, AddAssign, Sub};
use core::time::Duration;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A point in time, in nanoseconds since the driver's origin. Time never goes backwards within a
/// run: drivers must pass non-decreasing instants to a core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(u64);

impl Instant {
    /// The origin.
    pub const ZERO: Instant = Instant(0);
    /// A time later than any run reaches (about 584 years).
    pub const MAX: Instant = Instant(u64::MAX);

    /// An instant `nanos` nanoseconds after the origin.
    pub const fn from_nanos(nanos: u64) -> Self {
        Instant(nanos)
    }

    /// Nanoseconds since the origin.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Microseconds since the origin, truncated.
    pub const fn as_micros(self) -> u64 {
        self.0 / 1_000
    }

    /// The span from `earlier` to `self`, or zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    /// `self + d`, saturating at [`Instant::MAX`].
    pub fn saturating_add(self, d: Duration) -> Instant {
        Instant(self.0.saturating_add(duration_nanos(d)))
    }
}

/// A duration in whole nanoseconds, saturating at `u64::MAX` (584 years).
fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, d: Duration) -> Instant {
        self.saturating_add(d)
    }
}

impl AddAssign<Duration> for Instant {
    fn add_assign(&mut self, d: Duration) {
        *self = *self + d;
    }
}

impl Sub<Instant> for Instant {
    type Output = Duration;
    /// Saturating: an earlier minus a later instant is zero.
    fn sub(self, earlier: Instant) -> Duration {
        self.saturating_duration_since(earlier)
    }
}

/// A source of [`Instant`]s for drivers (never for cores).
pub trait Clock: Send + Sync {
    /// The current time.
    fn now(&self) -> Instant;
}

/// The real monotonic clock, with its origin at construction.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    origin: std::time::Instant,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        MonotonicClock { origin: std::time::Instant::now() }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Instant {
        Instant(duration_nanos(self.origin.elapsed()))
    }
}

/// A clock that moves only when told to: for deterministic tests and the simulator. Clones share
/// the same time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at the origin.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock to `t`; a `t` earlier than the current time is ignored, so time never goes
    /// backwards.
    pub fn advance_to(&self, t: Instant) {
        // Relaxed: the value is the only shared state; readers need no other memory ordered by it.
        self.nanos.fetch_max(t.0, Ordering::Relaxed);
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.nanos.fetch_add(duration_nanos(d), Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        Instant(self.nanos.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        let t = Instant::from_nanos(10);
        assert_eq!(t + Duration::from_nanos(5), Instant::from_nanos(15));
        assert_eq!(Instant::MAX + Duration::from_secs(1), Instant::MAX);
        assert_eq!(Instant::from_nanos(3) - t, Duration::ZERO);
        assert_eq!(t - Instant::from_nanos(3), Duration::from_nanos(7));
    }

    #[test]
    fn manual_clock_never_goes_back() {
        let c = ManualClock::new();
        c.advance_to(Instant::from_nanos(100));
        c.advance_to(Instant::from_nanos(50));
        assert_eq!(c.now(), Instant::from_nanos(100));
        let shared = c.clone();
        shared.advance(Duration::from_nanos(1));
        assert_eq!(c.now(), Instant::from_nanos(101));
    }
}
