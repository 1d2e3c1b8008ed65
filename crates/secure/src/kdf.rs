//! Key derivation (HKDF-SHA256, RFC 5869) and the AEADs frames are sealed with.
//!
//! Every key of the fabric comes from the fabric key through HKDF, PSP-style: from the key and the
//! identifiers of what it protects, so that nothing but the fabric key is ever distributed:
//!
//! - the handshake key (HMAC-SHA256 of handshake messages):
//!   `HKDF(salt = "lanbus fabric v1", ikm = fabric key, info = "lanbus handshake v1")`;
//! - a sender's broadcast key (its heartbeats to its group):
//!   `HKDF(salt = "lanbus fabric v1", ikm = fabric key,
//!   info = "lanbus broadcast v1" | group (2) | sender MAC (6) | sender epoch (4))`;
//! - a session's two keys, 64 bytes, initiator to responder first:
//!   `HKDF(salt = initiator nonce | responder nonce, ikm = fabric key, info = "lanbus session v1" |
//!   initiator MAC | responder MAC | initiator epoch | responder epoch | initiator session id |
//!   responder session id | suite (1))`.
//!
//! Integers are big-endian. `docs/wire.md` has the same, and `tests/kdf_vectors.json` values that
//! Python's `cryptography` package reproduces.

use aws_lc_rs::{aead, hkdf, hmac};
use lanbus_wire::MacAddr;
use zeroize::Zeroizing;

use crate::key::FabricKey;

const FABRIC_SALT: &[u8] = b"lanbus fabric v1";

/// The AEAD a session seals its frames with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suite {
    /// AES-256-GCM (1): where the CPU has AES and carry-less multiply instructions.
    Aes256Gcm,
    /// ChaCha20-Poly1305 (2): where it lacks them.
    ChaCha20Poly1305,
}

impl Suite {
    /// The suite this CPU runs faster.
    pub fn preferred() -> Suite {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("aes") && std::arch::is_x86_feature_detected!("pclmulqdq")
            {
                return Suite::Aes256Gcm;
            }
            Suite::ChaCha20Poly1305
        }
        #[cfg(not(target_arch = "x86_64"))]
        Suite::Aes256Gcm
    }

    /// The code on the wire.
    pub fn code(self) -> u8 {
        match self {
            Suite::Aes256Gcm => 1,
            Suite::ChaCha20Poly1305 => 2,
        }
    }

    /// The suite of a code, if known.
    pub fn from_code(code: u8) -> Option<Suite> {
        match code {
            1 => Some(Suite::Aes256Gcm),
            2 => Some(Suite::ChaCha20Poly1305),
            _ => None,
        }
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Suite::Aes256Gcm => "AES-256-GCM",
            Suite::ChaCha20Poly1305 => "ChaCha20-Poly1305",
        }
    }

    fn algorithm(self) -> &'static aead::Algorithm {
        match self {
            Suite::Aes256Gcm => &aead::AES_256_GCM,
            Suite::ChaCha20Poly1305 => &aead::CHACHA20_POLY1305,
        }
    }
}

/// Bytes of an AEAD tag.
pub const TAG_LEN: usize = 16;

/// One direction's AEAD key, ready to seal or open.
pub struct SealKey {
    key: aead::LessSafeKey,
    suite: Suite,
}

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SealKey({})", self.suite.name())
    }
}

fn nonce(counter: u64) -> aead::Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_be_bytes());
    aead::Nonce::assume_unique_for_key(n)
}

impl SealKey {
    /// A key of `suite` from 32 bytes of derived key material.
    pub fn new(suite: Suite, bytes: &[u8; 32]) -> SealKey {
        let unbound = aead::UnboundKey::new(suite.algorithm(), bytes)
            .expect("32 bytes is the key length of both suites");
        SealKey { key: aead::LessSafeKey::new(unbound), suite }
    }

    /// The suite.
    pub fn suite(&self) -> Suite {
        self.suite
    }

    /// Encrypts `in_out` in place under `counter` (which the caller never reuses with this key)
    /// and returns the tag over `aad` and the ciphertext. An empty `in_out` authenticates `aad`.
    pub fn seal(&self, counter: u64, aad: &[u8], in_out: &mut [u8]) -> [u8; TAG_LEN] {
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce(counter), aead::Aad::from(aad), in_out)
            .expect("frames are far below the AEAD's length limit");
        let mut out = [0u8; TAG_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Checks and decrypts `in_out` (ciphertext followed by its tag) in place; returns whether the
    /// tag was right (then `in_out[..len - TAG_LEN]` is the plaintext).
    pub fn open(&self, counter: u64, aad: &[u8], in_out: &mut [u8]) -> bool {
        self.key.open_in_place(nonce(counter), aead::Aad::from(aad), in_out).is_ok()
    }
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

fn expand(prk: &hkdf::Prk, info: &[&[u8]], out: &mut [u8]) {
    prk.expand(info, Len(out.len())).and_then(|okm| okm.fill(out)).expect("lengths far below HKDF's limit");
}

fn fabric_prk(key: &FabricKey) -> hkdf::Prk {
    hkdf::Salt::new(hkdf::HKDF_SHA256, FABRIC_SALT).extract(key.secret())
}

/// The handshake key's bytes (for the test vectors).
pub fn handshake_key_bytes(key: &FabricKey) -> Zeroizing<[u8; 32]> {
    let mut out = Zeroizing::new([0u8; 32]);
    expand(&fabric_prk(key), &[b"lanbus handshake v1"], &mut out[..]);
    out
}

/// The HMAC key handshake messages are tagged with.
pub fn handshake_key(key: &FabricKey) -> hmac::Key {
    hmac::Key::new(hmac::HMAC_SHA256, &handshake_key_bytes(key)[..])
}

/// A sender's broadcast key's bytes.
pub fn broadcast_key_bytes(key: &FabricKey, group: u16, sender: MacAddr, epoch: u32) -> Zeroizing<[u8; 32]> {
    let mut out = Zeroizing::new([0u8; 32]);
    expand(
        &fabric_prk(key),
        &[b"lanbus broadcast v1", &group.to_be_bytes(), &sender.0, &epoch.to_be_bytes()],
        &mut out[..],
    );
    out
}

/// What a session's keys are derived from: both sides' identifiers and nonces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionParams {
    /// The initiator's MAC.
    pub initiator: MacAddr,
    /// The responder's MAC.
    pub responder: MacAddr,
    /// The initiator's epoch.
    pub initiator_epoch: u32,
    /// The responder's epoch.
    pub responder_epoch: u32,
    /// The session id the initiator receives under.
    pub initiator_session: u32,
    /// The session id the responder receives under.
    pub responder_session: u32,
    /// The initiator's nonce.
    pub initiator_nonce: [u8; 32],
    /// The responder's nonce.
    pub responder_nonce: [u8; 32],
    /// The AEAD.
    pub suite: Suite,
}

/// A session's keys' bytes: initiator to responder, then responder to initiator.
pub fn session_key_bytes(key: &FabricKey, p: &SessionParams) -> Zeroizing<[u8; 64]> {
    let mut salt = [0u8; 64];
    salt[..32].copy_from_slice(&p.initiator_nonce);
    salt[32..].copy_from_slice(&p.responder_nonce);
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &salt).extract(key.secret());
    let mut out = Zeroizing::new([0u8; 64]);
    expand(
        &prk,
        &[
            b"lanbus session v1",
            &p.initiator.0,
            &p.responder.0,
            &p.initiator_epoch.to_be_bytes(),
            &p.responder_epoch.to_be_bytes(),
            &p.initiator_session.to_be_bytes(),
            &p.responder_session.to_be_bytes(),
            &[p.suite.code()],
        ],
        &mut out[..],
    );
    out
}

/// A session's two AEAD keys: (initiator to responder, responder to initiator).
pub fn session_keys(key: &FabricKey, p: &SessionParams) -> (SealKey, SealKey) {
    let bytes = session_key_bytes(key, p);
    let (a, b) = bytes.split_at(32);
    (
        SealKey::new(p.suite, a.try_into().expect("32 bytes")),
        SealKey::new(p.suite, b.try_into().expect("32 bytes")),
    )
}
