//! The keyed fabric: members prove they hold a fabric key before anything flows, and every frame
//! is sealed (authenticated, and encrypted on request) under keys derived from it.
//!
//! Layer: between the transport and a port. [`SecurePort`] wraps any port: the transport above
//! it sees only frames from peers that completed the member handshake ([`handshake`]) with this
//! node, or broadcasts sealed under a key of the fabric, each frame once; everything else is
//! counted by reason and dropped before the transport sees it. The core ([`Guard`]) is sans-IO
//! and runs the same in the daemons and in tests on a logical clock.
//!
//! The scheme, in short (`docs/wire.md` has it byte by byte): a 256-bit fabric key per fabric,
//! named by a 32-bit id ([`key`]); a three-message handshake with fresh nonces from both sides and
//! both transports' epochs, tagged with HMAC-SHA256 under a key derived from the fabric key; two
//! session keys (one per direction) derived with HKDF from the fabric key, both nonces and both
//! sides' identifiers ([`kdf`]); frames sealed with AES-256-GCM (ChaCha20-Poly1305 where the CPU
//! lacks AES instructions) under a 64-bit transmit counter per direction, with a replay window.
//! Crypto comes from `aws-lc-rs` (AWS-LC); nothing here is home-made.
#![deny(missing_docs)]
#![deny(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub mod entropy;
mod guard;
pub mod handshake;
pub mod kdf;
pub mod key;
mod port;

pub use entropy::{Entropy, SeededEntropy, SystemEntropy};
pub use guard::{
    Guard, GuardConfig, GuardCounters, PeerReport, PeerState, Reason, Rejected, ReplayWindow, SecurityReport,
    REPLAY_WINDOW, TRAILER_LEN,
};
pub use kdf::Suite;
pub use key::{FabricKey, KeyError, KeyId, KeyRing};
pub use port::{SecurePort, SecurityView};

/// A node's key ring, shared between the layer and whoever rotates it (a `SIGHUP` handler): the
/// layer picks a new ring up at its next frame.
#[derive(Debug)]
pub struct Keys {
    ring: Mutex<Arc<KeyRing>>,
    generation: AtomicU64,
}

impl Keys {
    /// Shares `ring`.
    pub fn new(ring: KeyRing) -> Arc<Keys> {
        Arc::new(Keys { ring: Mutex::new(Arc::new(ring)), generation: AtomicU64::new(0) })
    }

    /// Replaces the ring (a rotation step).
    pub fn replace(&self, ring: KeyRing) {
        let mut held = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        *held = Arc::new(ring);
        // Release, under the lock: a layer that sees the new generation reads the new ring (it
        // takes the same lock in `snapshot`).
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// The ring now.
    pub fn ring(&self) -> Arc<KeyRing> {
        self.snapshot().1
    }

    /// How many times the ring was replaced.
    pub fn generation(&self) -> u64 {
        // Acquire: pairs with the Release in `replace`.
        self.generation.load(Ordering::Acquire)
    }

    fn snapshot(&self) -> (u64, Arc<KeyRing>) {
        let held = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        // Relaxed: read under the lock that `replace` bumps it under.
        (self.generation.load(Ordering::Relaxed), held.clone())
    }
}

#[cfg(test)]
mod tests;
