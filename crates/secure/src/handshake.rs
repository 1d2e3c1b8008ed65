//! The member handshake: three messages that prove both sides hold a fabric key, with fresh
//! nonces from each, and fix the session they then seal frames under.
//!
//! ```text
//! initiator                                              responder
//!   HELLO   (key id, its epoch, session id, nonce)   ->
//!                                                     <-  REPLY   (its own, and HELLO's echoed)
//!   CONFIRM (its own, and REPLY's echoed)            ->
//! ```
//!
//! Each message is the payload of a lanbus frame of kind 4 (120 bytes; `docs/wire.md` draws it):
//!
//! ```text
//!   0  step (1 HELLO, 2 REPLY, 3 CONFIRM)     1  suite (1 AES-256-GCM, 2 ChaCha20-Poly1305)
//!   2  reserved (2 bytes, zero)               4  key id
//!   8  sender's epoch                        12  sender's session id (frames to it carry it)
//!  16  sender's nonce (32 bytes)
//!  48  receiver's epoch (0 in HELLO)         52  receiver's session id (0 in HELLO)
//!  56  receiver's nonce (32 bytes, 0 in HELLO)
//!  88  tag: HMAC-SHA256(handshake key, "lanbus hs v1" | sender MAC | receiver MAC | bytes 0..88)
//! ```
//!
//! The REPLY's tag covers the initiator's nonce and the CONFIRM's the responder's, so each side
//! knows the other answered this handshake and not an old one. A HELLO alone proves only that
//! its sender once held the key (it may be replayed): a responder keeps the session it offers
//! apart until the CONFIRM, or a frame sealed under it, arrives.
//!
//! Invariants: [`HandshakeRepr::parse`] accepts any bytes without panicking; it checks lengths and
//! codes, not tags (the caller verifies with [`HandshakeRepr::verify`]).

use aws_lc_rs::hmac;
use lanbus_wire::MacAddr;

use crate::kdf::Suite;
use crate::key::KeyId;

/// Bytes of a handshake message.
pub const MESSAGE_LEN: usize = 120;
const TAGGED_LEN: usize = 88;
const LABEL: &[u8] = b"lanbus hs v1";

/// Which message of the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The initiator's offer (1).
    Hello,
    /// The responder's answer (2).
    Reply,
    /// The initiator's confirmation (3).
    Confirm,
}

impl Step {
    fn code(self) -> u8 {
        match self {
            Step::Hello => 1,
            Step::Reply => 2,
            Step::Confirm => 3,
        }
    }
}

/// One side's part of a handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Half {
    /// Its epoch (the incarnation of its transport).
    pub epoch: u32,
    /// The session id frames sent to it carry.
    pub session: u32,
    /// Its fresh random nonce.
    pub nonce: [u8; 32],
}

/// A handshake message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandshakeRepr {
    /// Which message.
    pub step: Step,
    /// The AEAD the session will use.
    pub suite: Suite,
    /// The fabric key it is proven with.
    pub key_id: KeyId,
    /// The sender's part.
    pub own: Half,
    /// The receiver's part as the sender knows it (zero in a HELLO).
    pub peer: Half,
    /// The HMAC tag.
    pub tag: [u8; 32],
}

/// Why a handshake message was refused before its tag was checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// Shorter than [`MESSAGE_LEN`].
    #[error("handshake message truncated")]
    Truncated,
    /// An unknown step or suite code, or non-zero reserved bytes.
    #[error("handshake message malformed")]
    Malformed,
}

impl HandshakeRepr {
    /// Parses a message (bytes after [`MESSAGE_LEN`] are ignored).
    pub fn parse(b: &[u8]) -> Result<HandshakeRepr, HandshakeError> {
        if b.len() < MESSAGE_LEN {
            return Err(HandshakeError::Truncated);
        }
        let step = match b[0] {
            1 => Step::Hello,
            2 => Step::Reply,
            3 => Step::Confirm,
            _ => return Err(HandshakeError::Malformed),
        };
        let suite = Suite::from_code(b[1]).ok_or(HandshakeError::Malformed)?;
        if b[2] != 0 || b[3] != 0 {
            return Err(HandshakeError::Malformed);
        }
        let be32 = |at: usize| u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let half = |at: usize| Half {
            epoch: be32(at),
            session: be32(at + 4),
            nonce: b[at + 8..at + 40].try_into().expect("32 bytes"),
        };
        Ok(HandshakeRepr {
            step,
            suite,
            key_id: KeyId(be32(4)),
            own: half(8),
            peer: half(48),
            tag: b[TAGGED_LEN..MESSAGE_LEN].try_into().expect("32 bytes"),
        })
    }

    fn emit_body(&self, b: &mut [u8; TAGGED_LEN]) {
        b[0] = self.step.code();
        b[1] = self.suite.code();
        b[2..4].fill(0);
        b[4..8].copy_from_slice(&self.key_id.0.to_be_bytes());
        for (at, h) in [(8, &self.own), (48, &self.peer)] {
            b[at..at + 4].copy_from_slice(&h.epoch.to_be_bytes());
            b[at + 4..at + 8].copy_from_slice(&h.session.to_be_bytes());
            b[at + 8..at + 40].copy_from_slice(&h.nonce);
        }
    }

    fn tag_over(&self, key: &hmac::Key, sender: MacAddr, receiver: MacAddr) -> hmac::Context {
        let mut body = [0u8; TAGGED_LEN];
        self.emit_body(&mut body);
        let mut ctx = hmac::Context::with_key(key);
        ctx.update(LABEL);
        ctx.update(&sender.0);
        ctx.update(&receiver.0);
        ctx.update(&body);
        ctx
    }

    /// Computes and stores the tag for a message from `sender` to `receiver`.
    pub fn sign(&mut self, key: &hmac::Key, sender: MacAddr, receiver: MacAddr) {
        let tag = self.tag_over(key, sender, receiver).sign();
        self.tag.copy_from_slice(tag.as_ref());
    }

    /// Whether the tag is right for a message from `sender` to `receiver` (in constant time).
    pub fn verify(&self, key: &hmac::Key, sender: MacAddr, receiver: MacAddr) -> bool {
        let mut body = [0u8; TAGGED_LEN];
        self.emit_body(&mut body);
        let mut data = Vec::with_capacity(LABEL.len() + 12 + TAGGED_LEN);
        data.extend_from_slice(LABEL);
        data.extend_from_slice(&sender.0);
        data.extend_from_slice(&receiver.0);
        data.extend_from_slice(&body);
        hmac::verify(key, &data, &self.tag).is_ok()
    }

    /// Writes the message into `b` (at least [`MESSAGE_LEN`] bytes).
    pub fn emit(&self, b: &mut [u8]) {
        let mut body = [0u8; TAGGED_LEN];
        self.emit_body(&mut body);
        b[..TAGGED_LEN].copy_from_slice(&body);
        b[TAGGED_LEN..MESSAGE_LEN].copy_from_slice(&self.tag);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> HandshakeRepr {
        HandshakeRepr {
            step: Step::Reply,
            suite: Suite::Aes256Gcm,
            key_id: KeyId(0x0102_0304),
            own: Half { epoch: 7, session: 9, nonce: [3; 32] },
            peer: Half { epoch: 8, session: 10, nonce: [4; 32] },
            tag: [0; 32],
        }
    }

    #[test]
    fn emitted_bytes_have_the_documented_layout() {
        let mut m = sample();
        let key = hmac::Key::new(hmac::HMAC_SHA256, &[5; 32]);
        let (a, b) = (MacAddr::local(1), MacAddr::local(2));
        m.sign(&key, a, b);
        let mut buf = [0u8; MESSAGE_LEN];
        m.emit(&mut buf);
        assert_eq!(&buf[..12], &[2, 1, 0, 0, 1, 2, 3, 4, 0, 0, 0, 7]);
        assert_eq!(&buf[12..16], &[0, 0, 0, 9]);
        assert_eq!(&buf[48..56], &[0, 0, 0, 8, 0, 0, 0, 10]);
        let back = HandshakeRepr::parse(&buf).unwrap();
        assert_eq!(back, m);
        assert!(back.verify(&key, a, b));
        assert!(!back.verify(&key, b, a), "the tag binds the direction");
        let other = hmac::Key::new(hmac::HMAC_SHA256, &[6; 32]);
        assert!(!back.verify(&other, a, b), "and the key");
    }

    proptest! {
        #[test]
        fn parse_never_panics_and_round_trips(bytes in proptest::collection::vec(any::<u8>(), 0..160)) {
            if let Ok(m) = HandshakeRepr::parse(&bytes) {
                let mut buf = [0u8; MESSAGE_LEN];
                m.emit(&mut buf);
                prop_assert_eq!(&buf[..], &bytes[..MESSAGE_LEN]);
            }
        }

        #[test]
        fn any_flipped_bit_fails_the_tag(bit in 0usize..MESSAGE_LEN * 8) {
            let mut m = sample();
            let key = hmac::Key::new(hmac::HMAC_SHA256, &[5; 32]);
            m.sign(&key, MacAddr::local(1), MacAddr::local(2));
            let mut buf = [0u8; MESSAGE_LEN];
            m.emit(&mut buf);
            buf[bit / 8] ^= 1 << (bit % 8);
            if let Ok(back) = HandshakeRepr::parse(&buf) {
                prop_assert!(!back.verify(&key, MacAddr::local(1), MacAddr::local(2)));
            }
        }
    }
}
