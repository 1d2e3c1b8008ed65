//! Where the keyed fabric's randomness comes from: the system's generator in daemons, a seeded
//! one in the simulator and the tests, so that their runs repeat.

use aws_lc_rs::rand::SecureRandom as _;

/// A source of random bytes for nonces and session ids.
pub trait Entropy: Send {
    /// Fills `buf` with random bytes.
    fn fill(&mut self, buf: &mut [u8]);
}

/// The operating system's generator (getrandom), through aws-lc.
#[derive(Debug, Default)]
pub struct SystemEntropy;

impl Entropy for SystemEntropy {
    fn fill(&mut self, buf: &mut [u8]) {
        system_fill(buf);
    }
}

/// Fills `buf` from the operating system's generator.
pub(crate) fn system_fill(buf: &mut [u8]) {
    // The system generator fails only where getrandom is missing, which a kernel that runs
    // lanbus has; going on with predictable bytes would be worse than stopping.
    aws_lc_rs::rand::SystemRandom::new().fill(buf).expect("the system's random generator failed");
}

/// A generator from a seed (SplitMix64): for deterministic runs only, never for a real fabric.
#[derive(Debug, Clone)]
pub struct SeededEntropy(u64);

impl SeededEntropy {
    /// A generator whose output is fixed by `seed`.
    pub fn new(seed: u64) -> SeededEntropy {
        SeededEntropy(seed)
    }
}

impl Entropy for SeededEntropy {
    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
        }
    }
}
