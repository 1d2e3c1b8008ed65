//! Transport layer: sequence numbers, 32-bit serial numbers that wrap (RFC 1982 arithmetic, as TCP's).
//!
//! Invariant: two sequence numbers are only compared when they are less than 2^31 apart, which
//! holds because a window is far smaller than that.

use core::fmt;
use core::ops::{Add, Sub};

/// A wrapping frame sequence number.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Seq(pub u32);

impl Seq {
    /// `self - earlier` as an unsigned count (meaningful when `earlier` is not after `self`).
    pub const fn distance_from(self, earlier: Seq) -> u32 {
        self.0.wrapping_sub(earlier.0)
    }

    /// Whether `self` comes before `other` in serial order.
    pub const fn is_before(self, other: Seq) -> bool {
        (self.0.wrapping_sub(other.0) as i32) < 0
    }
}

impl Add<u32> for Seq {
    type Output = Seq;
    fn add(self, n: u32) -> Seq {
        Seq(self.0.wrapping_add(n))
    }
}

impl Sub<Seq> for Seq {
    type Output = i32;
    /// The signed serial distance `self - other`.
    fn sub(self, other: Seq) -> i32 {
        self.0.wrapping_sub(other.0) as i32
    }
}

impl fmt::Debug for Seq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Seq({})", self.0)
    }
}

impl fmt::Display for Seq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps() {
        let a = Seq(u32::MAX - 1);
        let b = a + 3;
        assert_eq!(b, Seq(1));
        assert_eq!(b - a, 3);
        assert_eq!(a - b, -3);
        assert!(a.is_before(b) && !b.is_before(a) && !a.is_before(a));
        assert_eq!(b.distance_from(a), 3);
    }
}
