//! The keyed fabric: members prove they hold a fabric key before anything flows, and every frame
//! is sealed (authenticated, and encrypted on request) under keys derived from it.
//!
//! Layer: between the transport and a port. [`SecurePort`] wraps any port: the transport above
//! it sees only frames from peers that completed the member handshake ([`handshake`]) with this
//! node, each frame once (a member's broadcast from a node without a session starts one); everything else is
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

/// The fuzz entry point: `data` split into frames (a 2-byte length before each) opened by a
/// member that holds a session with another, after the other's real frames; then the handshake
/// and key-file decoders on the whole input. Nothing may panic, and nothing unsealed, forged or
/// replayed may be delivered.
#[cfg(fuzzing)]
pub fn fuzz_frames(data: &[u8]) {
    fuzz::run(data)
}

#[cfg(any(fuzzing, test))]
mod fuzz {
    use lanbus_wire::{EtherType, Instant, MacAddr};

    use crate::guard::{Guard, GuardConfig};
    use crate::{FabricKey, KeyId, KeyRing, Keys, SeededEntropy, Suite};

    fn node(n: u32, encrypt: bool) -> Guard {
        let keys = Keys::new(KeyRing::new(FabricKey::from_parts(KeyId(1), [1; 32]), []));
        let config = GuardConfig { encrypt, suite: Suite::Aes256Gcm, broadcast_counter_start: 1 };
        Guard::new(MacAddr::local(n), keys, config, Box::new(SeededEntropy::new(u64::from(n))))
    }

    fn data_frame(src: MacAddr, dst: MacAddr, epoch: u32) -> Vec<u8> {
        let mut f = vec![0u8; 54 + 8 + crate::TRAILER_LEN];
        f[..6].copy_from_slice(&dst.0);
        f[6..12].copy_from_slice(&src.0);
        f[12..14].copy_from_slice(&EtherType::LANBUS_RAW.to_be_bytes());
        let mut p = lanbus_wire::frame::Packet::new_unchecked(&mut f[14..]);
        p.set_version(lanbus_wire::frame::VERSION);
        p.set_kind(lanbus_wire::frame::Kind::Data);
        p.set_payload_len(8);
        p.set_epoch(epoch);
        f
    }

    pub(crate) fn run(data: &[u8]) {
        let encrypt = data.first().is_some_and(|b| b & 1 == 1);
        let (mut a, mut b) = (node(1, encrypt), node(2, encrypt));
        let now = Instant::from_nanos(1);
        let (am, bm) = (MacAddr::local(1), MacAddr::local(2));
        let mut scratch = Vec::new();
        // b announces itself; a starts a handshake; the two settle it.
        let mut hb = data_frame(bm, MacAddr::BROADCAST, 7);
        let _ = b.seal(now, &mut hb, 62);
        let mut f = data_frame(am, bm, 5);
        assert!(a.seal(now, &mut f, 62).is_none());
        for _ in 0..4 {
            while let Some(m) = a.poll_transmit() {
                assert!(b.open(now, &m, &mut scratch).is_none());
            }
            while let Some(m) = b.poll_transmit() {
                assert!(a.open(now, &m, &mut scratch).is_none());
            }
        }
        let mut f = data_frame(am, bm, 5);
        let n = a.seal(now, &mut f, 62).expect("a session after the handshake");
        assert!(b.open(now, &f[..n], &mut scratch).is_some());
        let opened = b.counters().opened;
        // Fuzzed frames: none of them may be delivered (none is sealed by a).
        let mut rest = &data[data.len().min(1)..];
        while rest.len() >= 2 {
            let len = usize::from(u16::from_be_bytes([rest[0], rest[1]])).min(rest.len() - 2);
            let frame = &rest[2..2 + len];
            rest = &rest[2 + len..];
            let _ = b.open(now, frame, &mut scratch);
            while b.poll_transmit().is_some() {}
        }
        assert_eq!(b.counters().opened, opened, "a fuzzed frame was delivered");
        let _ = crate::handshake::HandshakeRepr::parse(data);
        if let Ok(text) = std::str::from_utf8(data) {
            let _ = KeyRing::parse(text);
        }
    }

    #[test]
    fn the_fuzz_entry_runs() {
        run(&[0, 0, 3, 1, 2, 3, 0, 60]);
        run(&[1; 200]);
    }
}
