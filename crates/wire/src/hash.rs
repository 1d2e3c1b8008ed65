//! A cheap hash for maps keyed by numbers this process hands out itself (request and transaction
//! ids, channel keys): one multiply (Fibonacci hashing), where the standard library's keyed hash
//! would cost several times as much on every message's path and protects only against keys an
//! attacker picks, which these are not (or, for a peer's channel keys, only within a bounded map).

use std::hash::{BuildHasherDefault, Hasher};

/// Hashes by one multiply, whose high bits (the product of all the key's bits) are folded into
/// the low bits a table indexes by: keys that differ only in their high bits (a channel key's
/// MAC) spread as well as consecutive numbers do.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 32)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// Builds [`IdHasher`]s: `HashMap<K, V, BuildIdHasher>`.
pub type BuildIdHasher = BuildHasherDefault<IdHasher>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn consecutive_ids_and_keys_that_differ_high_spread_over_the_buckets() {
        // 1024 keys in a table of 1024 buckets (indexed by the low bits): a uniform hash fills
        // about 647 of them (1 - 1/e); ask for most of that.
        let filled = |keys: &mut dyn Iterator<Item = u64>| {
            keys.map(|k| BuildIdHasher::default().hash_one(k) & 1023)
                .collect::<std::collections::HashSet<_>>()
                .len()
        };
        for (what, n) in [
            ("consecutive", filled(&mut (0..1024u64))),
            ("every third", filled(&mut (0..1024u64).map(|i| i * 3))),
            ("high bits only", filled(&mut (0..1024u64).map(|i| (i << 16) | 7))),
            ("a MAC's top bytes", filled(&mut (0..1024u64).map(|i| (0x02_00_00_00_00_00 + i) << 16))),
        ] {
            assert!(n >= 560, "{what}: {n} of 1024 buckets");
        }
        let mut m = std::collections::HashMap::<u64, u64, BuildIdHasher>::default();
        for i in 0..10_000u64 {
            m.insert(i * 3, i);
        }
        assert!((0..10_000u64).all(|i| m.remove(&(i * 3)) == Some(i)));
    }
}
