//! The authentication layer's core: seals every frame a node sends and opens every frame it
//! receives, running the member handshake with each peer first. Sans-IO: the caller passes `now`
//! and the frames, and drains the handshake frames to send with [`Guard::poll_transmit`].
//!
//! A sealed frame (`docs/wire.md` draws it) is a lanbus frame with [`FLAG_SEALED`] set, the
//! checksum field holding the receiver's session id (the sender's fabric key id on a broadcast),
//! and 24 bytes after the payload: a 64-bit transmit counter, the AEAD's nonce, then the AEAD's
//! 16-byte tag over the Ethernet and lanbus headers and the payload (the payload encrypted where
//! [`FLAG_ENCRYPTED`] is set, then the tag covers its ciphertext and the headers).
//!
//! Invariants:
//! - a counter is never used twice under one key: each session direction and each broadcast key
//!   has its own counter, advanced for every frame sealed, retransmissions included (the transport
//!   hands a retransmission over as a new frame);
//! - nothing reaches the transport from a peer before a handshake proved it holds an accepted key:
//!   a member's broadcast (sealed under a key derived from the fabric key and the sender's
//!   identity) from a node without a session starts a handshake and is held back;
//! - a frame is delivered at most once (a 256-frame replay window per session and per broadcast
//!   sender), only from the incarnation (epoch) the session was made with;
//! - a responder's offered session replaces nothing until the initiator proves it took it (the
//!   CONFIRM, or a frame sealed under it): a replayed HELLO changes nothing;
//! - bytes from the network never panic: every rejection is counted by reason, per peer, and
//!   logged at most once per peer per minute.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use aws_lc_rs::hmac;
use lanbus_wire::ethernet::HEADER_LEN as ETH_LEN;
use lanbus_wire::frame::{
    self, Kind, FLAG_BROADCAST_KEY, FLAG_CHECKSUM, FLAG_ENCRYPTED, FLAG_SEALED, HEADER_LEN as LB_LEN,
};
use lanbus_wire::{EtherType, Instant, MacAddr};

use crate::entropy::Entropy;
use crate::handshake::{Half, HandshakeRepr, Step, MESSAGE_LEN};
use crate::kdf::{self, SealKey, SessionParams, Suite, TAG_LEN};
use crate::key::{KeyId, KeyRing};
use crate::Keys;

/// Bytes a sealed frame carries after its payload: the counter and the tag.
pub const TRAILER_LEN: usize = 8 + TAG_LEN;

const HDR: usize = ETH_LEN + LB_LEN;
const ID_FIELD: usize = frame::CHECKSUM_FRAME_OFFSET;
/// Frames a replay window remembers behind the highest counter seen.
pub const REPLAY_WINDOW: u64 = 256;
/// Peers the layer keeps state for; rejections from more MACs are counted only in the totals.
const MAX_PEERS: usize = 4096;
/// How long frames under a replaced session are still accepted (those in flight at the switch).
const PREVIOUS_GRACE: Duration = Duration::from_secs(2);
/// How long a responder keeps a session it offered and that was not taken.
const PENDING_LIFETIME: Duration = Duration::from_secs(5);
const FIRST_RETRY: Duration = Duration::from_millis(20);
const LAST_RETRY: Duration = Duration::from_secs(1);
const LOG_EVERY: Duration = Duration::from_secs(60);

/// How the layer seals.
#[derive(Debug, Clone, Copy)]
pub struct GuardConfig {
    /// Encrypt payloads, not only authenticate them.
    pub encrypt: bool,
    /// The AEAD of the sessions this node starts (a responder takes the initiator's).
    pub suite: Suite,
    /// The first counter of this node's broadcasts: later than any an earlier incarnation used
    /// (the driver gives the real time in nanoseconds), so receivers' replay windows hold across
    /// restarts.
    pub broadcast_counter_start: u64,
}

/// Frames refused from one peer (or all), by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rejected {
    /// Not sealed: the sender holds no key (or runs an open fabric).
    pub unsealed: u64,
    /// The tag did not verify: altered, forged, or sealed under another key.
    pub bad_tag: u64,
    /// A counter already seen (or older than the window): a replay.
    pub replay: u64,
    /// From another incarnation of the peer than its session's (a restart without a handshake).
    pub stale_epoch: u64,
    /// For a session this node does not have (an earlier one, or none yet).
    pub no_session: u64,
    /// Under a fabric key this node does not accept.
    pub unknown_key: u64,
    /// A handshake message that failed its proof (another key, or forged) or is malformed.
    pub bad_handshake: u64,
}

impl Rejected {
    /// All frames refused.
    pub fn total(&self) -> u64 {
        self.unsealed
            + self.bad_tag
            + self.replay
            + self.stale_epoch
            + self.no_session
            + self.unknown_key
            + self.bad_handshake
    }
}

/// Why a frame was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// See [`Rejected::unsealed`].
    Unsealed,
    /// See [`Rejected::bad_tag`].
    BadTag,
    /// See [`Rejected::replay`].
    Replay,
    /// See [`Rejected::stale_epoch`].
    StaleEpoch,
    /// See [`Rejected::no_session`].
    NoSession,
    /// See [`Rejected::unknown_key`].
    UnknownKey,
    /// See [`Rejected::bad_handshake`].
    BadHandshake,
}

impl Rejected {
    fn count(&mut self, r: Reason) {
        let c = match r {
            Reason::Unsealed => &mut self.unsealed,
            Reason::BadTag => &mut self.bad_tag,
            Reason::Replay => &mut self.replay,
            Reason::StaleEpoch => &mut self.stale_epoch,
            Reason::NoSession => &mut self.no_session,
            Reason::UnknownKey => &mut self.unknown_key,
            Reason::BadHandshake => &mut self.bad_handshake,
        };
        *c += 1;
    }
}

/// What the layer counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GuardCounters {
    /// Frames sealed and sent.
    pub sealed: u64,
    /// Frames opened and delivered.
    pub opened: u64,
    /// Handshakes this node started.
    pub handshakes_started: u64,
    /// Sessions established (as initiator or responder).
    pub sessions_established: u64,
    /// Frames the transport sent to a peer with no session yet: dropped (the transport sends
    /// them again) while the handshake runs.
    pub tx_waiting: u64,
    /// Received frames of another EtherType than lanbus's.
    pub drop_not_lanbus: u64,
    /// Frames too short for their headers, of another version, or with a payload past their end.
    pub drop_malformed: u64,
    /// Frames to another node.
    pub drop_not_for_us: u64,
    /// Broadcasts of another group than this node's from nodes it has no session with: a group's
    /// heartbeats reach only that group (and the peers already in session with their sender, who
    /// learn that it moved).
    pub drop_other_group: u64,
    /// Broadcasts of members (their tags verified) from nodes without a session yet: held back
    /// while the handshake they start runs.
    pub held_for_handshake: u64,
    /// Handshake messages from members (their tags verified) that fit no handshake in progress:
    /// sent again, answering one a newer handshake replaced, or replayed. Ignored.
    pub stale_handshakes: u64,
    /// Frames refused, by reason.
    pub rejected: Rejected,
}

/// Where the layer stands with a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerState {
    /// A session is established: its frames are delivered.
    Authenticated,
    /// A handshake is under way.
    Handshaking,
    /// No session: only refused frames were seen.
    Unauthenticated,
}

impl PeerState {
    /// Its name in status output.
    pub fn name(self) -> &'static str {
        match self {
            PeerState::Authenticated => "authenticated",
            PeerState::Handshaking => "handshaking",
            PeerState::Unauthenticated => "unauthenticated",
        }
    }
}

/// One peer in a [`SecurityReport`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerReport {
    /// Its MAC.
    pub mac: MacAddr,
    /// Its state.
    pub state: PeerState,
    /// The fabric key its session was proven with.
    pub key_id: Option<KeyId>,
    /// The session's AEAD.
    pub suite: Option<Suite>,
    /// Its frames refused, by reason.
    pub rejected: Rejected,
}

/// A snapshot of the layer for status output and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SecurityReport {
    /// The keys held, the one sent under first.
    pub key_ids: Vec<KeyId>,
    /// Whether payloads are encrypted.
    pub encrypt: bool,
    /// The counters.
    pub counters: GuardCounters,
    /// Every peer seen, by MAC.
    pub peers: Vec<PeerReport>,
}

/// The counters of the frames seen in one direction of a session or from one broadcaster: the
/// highest and a bitmap of the [`REPLAY_WINDOW`] below it (bit `i` is counter `top - i`).
#[derive(Debug, Clone, Default)]
pub struct ReplayWindow {
    top: u64,
    bits: [u64; 4],
    any: bool,
}

impl ReplayWindow {
    /// Whether `counter` is new (not seen, not older than the window).
    pub fn check(&self, counter: u64) -> bool {
        if !self.any || counter > self.top {
            return true;
        }
        let back = self.top - counter;
        back < REPLAY_WINDOW && self.bits[(back / 64) as usize] & (1 << (back % 64)) == 0
    }

    /// Records `counter` as seen (after its frame's tag verified).
    pub fn commit(&mut self, counter: u64) {
        if !self.any {
            *self = ReplayWindow { top: counter, bits: [1, 0, 0, 0], any: true };
            return;
        }
        if counter > self.top {
            self.shift(counter - self.top);
            self.top = counter;
            self.bits[0] |= 1;
        } else {
            let back = self.top - counter;
            if back < REPLAY_WINDOW {
                self.bits[(back / 64) as usize] |= 1 << (back % 64);
            }
        }
    }

    fn shift(&mut self, n: u64) {
        if n >= REPLAY_WINDOW {
            self.bits = [0; 4];
            return;
        }
        let (words, bits) = ((n / 64) as usize, (n % 64) as u32);
        let old = self.bits;
        for w in 0..4 {
            let mut v = 0;
            if w >= words {
                v |= old[w - words] << bits;
                if bits > 0 && w > words {
                    v |= old[w - words - 1] >> (64 - bits);
                }
            }
            self.bits[w] = v;
        }
    }
}

struct Session {
    key_id: KeyId,
    /// The id frames to this node carry.
    local_id: u32,
    /// The id frames to the peer carry.
    remote_id: u32,
    peer_epoch: u32,
    tx: SealKey,
    rx: SealKey,
    tx_counter: u64,
    window: ReplayWindow,
}

struct Initiating {
    hello: HandshakeRepr,
    frame: Vec<u8>,
    sent_at: Instant,
    retry: Duration,
    tries: u32,
}

struct Pending {
    session: Session,
    hello: HandshakeRepr,
    reply: HandshakeRepr,
    frame: Vec<u8>,
    expires: Instant,
}

#[derive(Default)]
struct Peer {
    current: Option<Session>,
    previous: Option<(Session, Instant)>,
    pending: Option<Pending>,
    initiating: Option<Initiating>,
    rekey: bool,
    rejected: Rejected,
    logged: Option<Instant>,
}

struct BroadcastRx {
    epoch: u32,
    key_id: KeyId,
    group: u16,
    key: SealKey,
    window: ReplayWindow,
}

struct BroadcastTx {
    group: u16,
    epoch: u32,
    key_id: KeyId,
    key: SealKey,
}

/// The authentication layer's core; see the module docs.
pub struct Guard {
    local: MacAddr,
    config: GuardConfig,
    keys: Arc<Keys>,
    generation: u64,
    ring: Arc<KeyRing>,
    handshake_keys: Vec<(KeyId, hmac::Key)>,
    peers: HashMap<MacAddr, Peer>,
    broadcast_tx: Option<BroadcastTx>,
    broadcast_counter: u64,
    broadcast_rx: HashMap<MacAddr, BroadcastRx>,
    outbox: VecDeque<Vec<u8>>,
    entropy: Box<dyn Entropy>,
    counters: GuardCounters,
    /// This node's epoch and group, as its transport's frames carry them (0 until it sent one).
    local_epoch: u32,
    local_group: u16,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn mac_at(b: &[u8], at: usize) -> MacAddr {
    MacAddr(b[at..at + 6].try_into().expect("6 bytes"))
}

impl Guard {
    /// A layer for the node at `local` holding `keys`.
    pub fn new(local: MacAddr, keys: Arc<Keys>, config: GuardConfig, entropy: Box<dyn Entropy>) -> Guard {
        let (generation, ring) = keys.snapshot();
        let handshake_keys = derive_handshake_keys(&ring);
        Guard {
            local,
            config,
            keys,
            generation,
            ring,
            handshake_keys,
            peers: HashMap::new(),
            broadcast_tx: None,
            broadcast_counter: config.broadcast_counter_start,
            broadcast_rx: HashMap::new(),
            outbox: VecDeque::new(),
            entropy,
            counters: GuardCounters::default(),
            local_epoch: 0,
            local_group: 0,
        }
    }

    /// The counters.
    pub fn counters(&self) -> GuardCounters {
        self.counters
    }

    /// Whether a session with `peer` is established.
    pub fn is_authenticated(&self, peer: MacAddr) -> bool {
        self.peers.get(&peer).is_some_and(|p| p.current.is_some())
    }

    /// A snapshot for status output.
    pub fn report(&self) -> SecurityReport {
        let mut peers: Vec<PeerReport> = self
            .peers
            .iter()
            .map(|(mac, p)| {
                let state = if p.current.is_some() {
                    PeerState::Authenticated
                } else if p.initiating.is_some() || p.pending.is_some() {
                    PeerState::Handshaking
                } else {
                    PeerState::Unauthenticated
                };
                PeerReport {
                    mac: *mac,
                    state,
                    key_id: p.current.as_ref().map(|s| s.key_id),
                    suite: p.current.as_ref().map(|s| s.tx.suite()),
                    rejected: p.rejected,
                }
            })
            .collect();
        peers.sort_by_key(|p| p.mac.0);
        SecurityReport {
            key_ids: self.ring.ids(),
            encrypt: self.config.encrypt,
            counters: self.counters,
            peers,
        }
    }

    /// The next handshake frame to send, if any.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        self.outbox.pop_front()
    }

    /// Picks up a changed key ring: sessions under keys no longer accepted end, and sessions under
    /// another key than the one now sent under are made again (they carry on until then).
    fn refresh_keys(&mut self, now: Instant) {
        if self.keys.generation() == self.generation {
            return;
        }
        let (generation, ring) = self.keys.snapshot();
        self.generation = generation;
        self.ring = ring;
        self.handshake_keys = derive_handshake_keys(&self.ring);
        self.broadcast_tx = None;
        let send = self.ring.send_key().id();
        let ring = self.ring.clone();
        let mut again = Vec::new();
        for (mac, peer) in self.peers.iter_mut() {
            let accepted = |s: &Session| ring.find(s.key_id).is_some();
            if peer.current.as_ref().is_some_and(|s| !accepted(s)) {
                peer.current = None;
                again.push(*mac);
            }
            if peer.previous.as_ref().is_some_and(|(s, _)| !accepted(s)) {
                peer.previous = None;
            }
            if peer.pending.as_ref().is_some_and(|p| !accepted(&p.session)) {
                peer.pending = None;
            }
            if peer.initiating.as_ref().is_some_and(|i| i.hello.key_id != send) {
                peer.initiating = None;
            }
            peer.rekey = peer.current.as_ref().is_some_and(|s| s.key_id != send);
            if peer.rekey {
                again.push(*mac);
            }
        }
        self.broadcast_rx.retain(|_, b| ring.find(b.key_id).is_some());
        // Start the new handshakes now rather than at the next frame, so that a quiet link is
        // ready under the new key too.
        for mac in again {
            self.want_session(now, mac);
        }
    }

    fn handshake_key(&self, id: KeyId) -> Option<&hmac::Key> {
        self.handshake_keys.iter().find(|(k, _)| *k == id).map(|(_, key)| key)
    }

    fn peer(&mut self, mac: MacAddr) -> Option<&mut Peer> {
        if self.peers.len() >= MAX_PEERS && !self.peers.contains_key(&mac) {
            return None;
        }
        Some(self.peers.entry(mac).or_default())
    }

    fn reject(&mut self, now: Instant, src: MacAddr, reason: Reason) {
        self.counters.rejected.count(reason);
        let Some(peer) = self.peer(src) else { return };
        peer.rejected.count(reason);
        if matches!(reason, Reason::Replay | Reason::NoSession | Reason::StaleEpoch) {
            return;
        }
        if peer.logged.is_some_and(|t| now.saturating_duration_since(t) < LOG_EVERY) {
            return;
        }
        peer.logged = Some(now);
        match reason {
            Reason::Unsealed => tracing::warn!(
                "frames from {src} are not sealed: a node without this fabric's key is on the segment \
                 (dropped; said once a minute per node)"
            ),
            Reason::UnknownKey => tracing::warn!(
                "{src} uses a fabric key this node does not hold (dropped; said once a minute per node)"
            ),
            Reason::BadHandshake => tracing::warn!(
                "{src} failed the key handshake: it holds another fabric key, or is an impostor \
                 (dropped; said once a minute per node)"
            ),
            _ => tracing::warn!(
                "frames from {src} fail their tag: altered in flight or forged (dropped; said once a \
                 minute per node)"
            ),
        }
    }

    fn random_half(&mut self, avoid: &[u32]) -> Half {
        let mut bytes = [0u8; 36];
        loop {
            self.entropy.fill(&mut bytes);
            let session = u32::from_be_bytes(bytes[32..].try_into().expect("4 bytes"));
            if session != 0 && !avoid.contains(&session) {
                let nonce = bytes[..32].try_into().expect("32 bytes");
                return Half { epoch: self.local_epoch, session, nonce };
            }
        }
    }

    fn handshake_frame(&self, dst: MacAddr, peer_epoch: u32, m: &HandshakeRepr) -> Vec<u8> {
        let mut f = vec![0u8; HDR + MESSAGE_LEN];
        f[..6].copy_from_slice(&dst.0);
        f[6..12].copy_from_slice(&self.local.0);
        f[12..14].copy_from_slice(&EtherType::LANBUS_RAW.to_be_bytes());
        let mut p = frame::Packet::new_unchecked(&mut f[ETH_LEN..]);
        p.set_version(frame::VERSION);
        p.set_kind(Kind::Handshake);
        p.set_group(self.local_group);
        p.set_payload_len(MESSAGE_LEN as u16);
        p.set_epoch(self.local_epoch);
        p.set_peer_epoch(peer_epoch);
        m.emit(&mut f[HDR..]);
        f
    }

    /// Starts a handshake with `dst` (or sends the HELLO again once its retry time has come).
    fn want_session(&mut self, now: Instant, dst: MacAddr) {
        if self.local_epoch == 0 {
            return;
        }
        let local = self.local;
        let send = self.ring.send_key().clone();
        let suite = self.config.suite;
        let Some(peer) = self.peer(dst) else { return };
        if peer.pending.as_ref().is_some_and(|p| now <= p.expires) {
            // The peer is making a session with us: its CONFIRM (or first frame) settles it. A
            // handshake of our own now would race it to two sessions.
            return;
        }
        if let Some(i) = &mut peer.initiating {
            if now < i.sent_at + i.retry {
                return;
            }
            i.sent_at = now;
            i.retry = (i.retry * 2).min(LAST_RETRY);
            i.tries += 1;
            if i.tries == 6 {
                tracing::warn!(
                    "{dst} does not answer the key handshake: it holds another fabric key, or none \
                     (still trying)"
                );
            }
            let frame = i.frame.clone();
            self.outbox.push_back(frame);
            return;
        }
        let avoid: Vec<u32> = peer.current.iter().map(|s| s.local_id).collect();
        let own = self.random_half(&avoid);
        let mut hello = HandshakeRepr {
            step: Step::Hello,
            suite,
            key_id: send.id(),
            own,
            peer: Half::default(),
            tag: [0; 32],
        };
        let Some(key) = self.handshake_key(send.id()) else { return };
        hello.sign(key, local, dst);
        let frame = self.handshake_frame(dst, 0, &hello);
        self.outbox.push_back(frame.clone());
        self.counters.handshakes_started += 1;
        if let Some(peer) = self.peer(dst) {
            peer.initiating = Some(Initiating { hello, frame, sent_at: now, retry: FIRST_RETRY, tries: 0 });
        }
    }

    /// Seals the frame in `buf[..len]` (a whole Ethernet frame from the transport) in place for
    /// sending and returns its new length, or `None` when it must not be sent: not a lanbus frame,
    /// or for a peer with no session yet (a handshake is started; the transport sends the frame
    /// again). `buf` must have [`TRAILER_LEN`] bytes of room after `len`.
    #[must_use]
    pub fn seal(&mut self, now: Instant, buf: &mut [u8], len: usize) -> Option<usize> {
        self.refresh_keys(now);
        if len < HDR || buf.len() < len + TRAILER_LEN || buf[ETH_LEN] != frame::VERSION {
            self.counters.drop_malformed += 1;
            return None;
        }
        if be16(buf, 12) != EtherType::LANBUS_RAW {
            self.counters.drop_not_lanbus += 1;
            return None;
        }
        let end = HDR + usize::from(be16(buf, ETH_LEN + 24));
        if end > len {
            self.counters.drop_malformed += 1;
            return None;
        }
        let dst = mac_at(buf, 0);
        self.local_epoch = be32(buf, ETH_LEN + 32);
        self.local_group = be16(buf, ETH_LEN + 4);
        let broadcast = dst.is_multicast();
        let flags = (buf[ETH_LEN + 2] & !(FLAG_CHECKSUM | FLAG_ENCRYPTED | FLAG_BROADCAST_KEY))
            | FLAG_SEALED
            | if self.config.encrypt { FLAG_ENCRYPTED } else { 0 }
            | if broadcast { FLAG_BROADCAST_KEY } else { 0 };
        buf[ETH_LEN + 2] = flags;
        let (id, counter);
        let key: &SealKey = if broadcast {
            let send = self.ring.send_key();
            let (group, epoch) = (self.local_group, self.local_epoch);
            let fresh = self
                .broadcast_tx
                .as_ref()
                .is_some_and(|b| b.group == group && b.epoch == epoch && b.key_id == send.id());
            if !fresh {
                let bytes = kdf::broadcast_key_bytes(send, group, self.local, epoch);
                self.broadcast_tx = Some(BroadcastTx {
                    group,
                    epoch,
                    key_id: send.id(),
                    key: SealKey::new(Suite::Aes256Gcm, &bytes),
                });
            }
            counter = self.broadcast_counter;
            self.broadcast_counter += 1;
            let b = self.broadcast_tx.as_ref().expect("set above");
            id = b.key_id.0;
            &b.key
        } else {
            let Some(peer) = self.peer(dst) else {
                self.counters.tx_waiting += 1;
                return None;
            };
            let rekey = peer.rekey && peer.initiating.is_none();
            if peer.current.is_none() || rekey {
                let waiting = peer.current.is_none();
                self.want_session(now, dst);
                if waiting {
                    self.counters.tx_waiting += 1;
                    return None;
                }
            }
            let s = self.peers.get_mut(&dst).and_then(|p| p.current.as_mut()).expect("checked above");
            counter = s.tx_counter;
            s.tx_counter += 1;
            id = s.remote_id;
            &s.tx
        };
        buf[ID_FIELD..ID_FIELD + 4].copy_from_slice(&id.to_be_bytes());
        // A broadcast's tag leaves the destination out (taken as zero): see FLAG_BROADCAST_KEY.
        if broadcast {
            buf[..6].fill(0);
        }
        let tag = if self.config.encrypt {
            let (head, rest) = buf.split_at_mut(HDR);
            key.seal(counter, head, &mut rest[..end - HDR])
        } else {
            key.seal(counter, &buf[..end], &mut [])
        };
        if broadcast {
            buf[..6].copy_from_slice(&dst.0);
        }
        buf[end..end + 8].copy_from_slice(&counter.to_be_bytes());
        buf[end + 8..end + TRAILER_LEN].copy_from_slice(&tag);
        self.counters.sealed += 1;
        Some(end + TRAILER_LEN)
    }

    /// Opens a received frame: returns the frame to hand to the transport (without the trailer,
    /// decrypted into `scratch` where it was encrypted), or `None` when it is refused or was a
    /// handshake message (consumed here; an answer may wait in [`Guard::poll_transmit`]).
    #[must_use]
    pub fn open<'a>(&mut self, now: Instant, frame: &'a [u8], scratch: &'a mut Vec<u8>) -> Option<&'a [u8]> {
        self.refresh_keys(now);
        if frame.len() < HDR || frame[ETH_LEN] != frame::VERSION {
            if frame.len() >= ETH_LEN && be16(frame, 12) != EtherType::LANBUS_RAW {
                self.counters.drop_not_lanbus += 1;
            } else {
                self.counters.drop_malformed += 1;
            }
            return None;
        }
        if be16(frame, 12) != EtherType::LANBUS_RAW {
            self.counters.drop_not_lanbus += 1;
            return None;
        }
        let (dst, src) = (mac_at(frame, 0), mac_at(frame, 6));
        if src == self.local || src.is_multicast() || (dst != self.local && !dst.is_multicast()) {
            self.counters.drop_not_for_us += 1;
            return None;
        }
        let end = HDR + usize::from(be16(frame, ETH_LEN + 24));
        if end > frame.len() {
            self.counters.drop_malformed += 1;
            return None;
        }
        if Kind::from(frame[ETH_LEN + 1]) == Kind::Handshake {
            if dst == self.local {
                self.handle_handshake(now, src, be32(frame, ETH_LEN + 32), &frame[HDR..end]);
            } else {
                self.counters.drop_not_for_us += 1;
            }
            return None;
        }
        let flags = frame[ETH_LEN + 2];
        if flags & FLAG_SEALED == 0 {
            self.reject(now, src, Reason::Unsealed);
            return None;
        }
        if frame.len() < end + TRAILER_LEN {
            self.reject(now, src, Reason::BadTag);
            return None;
        }
        let counter = u64::from_be_bytes(frame[end..end + 8].try_into().expect("8 bytes"));
        let tag: [u8; TAG_LEN] = frame[end + 8..end + TRAILER_LEN].try_into().expect("16 bytes");
        let id = be32(frame, ID_FIELD);
        let epoch = be32(frame, ETH_LEN + 32);
        let encrypted = flags & FLAG_ENCRYPTED != 0;
        if flags & FLAG_BROADCAST_KEY != 0 {
            return self.open_broadcast(now, src, frame, end, counter, tag, id, epoch, encrypted, scratch);
        }
        if dst != self.local {
            // A broadcast sealed under a session key: not what a member sends.
            self.reject(now, src, Reason::BadTag);
            return None;
        }
        enum Which {
            Current,
            Previous,
            Pending,
        }
        let which = {
            let Some(peer) = self.peers.get_mut(&src) else {
                self.reject(now, src, Reason::NoSession);
                self.want_session(now, src);
                return None;
            };
            if peer.previous.as_ref().is_some_and(|(_, until)| now > *until) {
                peer.previous = None;
            }
            if peer.pending.as_ref().is_some_and(|p| now > p.expires) {
                peer.pending = None;
            }
            if peer.current.as_ref().is_some_and(|s| s.local_id == id) {
                Which::Current
            } else if peer.previous.as_ref().is_some_and(|(s, _)| s.local_id == id) {
                Which::Previous
            } else if peer.pending.as_ref().is_some_and(|p| p.session.local_id == id) {
                Which::Pending
            } else {
                let lost = peer.current.is_none() && peer.pending.is_none();
                self.reject(now, src, Reason::NoSession);
                // A peer sealing for a session this node lacks kept one with an earlier
                // incarnation of it: a new handshake lets both carry on.
                if lost {
                    self.want_session(now, src);
                }
                return None;
            }
        };
        let peer = self.peers.get_mut(&src).expect("looked up above");
        let session = match which {
            Which::Current => peer.current.as_mut(),
            Which::Previous => peer.previous.as_mut().map(|(s, _)| s),
            Which::Pending => peer.pending.as_mut().map(|p| &mut p.session),
        }
        .expect("found above");
        if !session.window.check(counter) {
            self.reject(now, src, Reason::Replay);
            return None;
        }
        let Some(out) = open_with(&session.rx, frame, end, counter, tag, encrypted, scratch) else {
            self.reject(now, src, Reason::BadTag);
            return None;
        };
        if session.peer_epoch == 0 {
            // The responder did not know its epoch when it answered; only it holds these keys,
            // so the first frame it seals under them names its epoch.
            session.peer_epoch = epoch;
        } else if epoch != session.peer_epoch {
            self.reject(now, src, Reason::StaleEpoch);
            return None;
        }
        session.window.commit(counter);
        if let Which::Pending = which {
            self.promote(now, src);
        }
        self.counters.opened += 1;
        Some(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn open_broadcast<'a>(
        &mut self,
        now: Instant,
        src: MacAddr,
        frame: &'a [u8],
        end: usize,
        counter: u64,
        tag: [u8; TAG_LEN],
        id: u32,
        epoch: u32,
        encrypted: bool,
        scratch: &'a mut Vec<u8>,
    ) -> Option<&'a [u8]> {
        let key_id = KeyId(id);
        let Some(fabric_key) = self.ring.find(key_id) else {
            self.reject(now, src, Reason::UnknownKey);
            return None;
        };
        let group = be16(frame, ETH_LEN + 4);
        // Until this node has sent a frame it does not know its group, and hears every group.
        let known = self.local_epoch != 0;
        if known && group != self.local_group && self.peers.get(&src).is_none_or(|p| p.current.is_none()) {
            self.counters.drop_other_group += 1;
            return None;
        }
        if self.broadcast_rx.len() >= MAX_PEERS && !self.broadcast_rx.contains_key(&src) {
            self.counters.drop_not_for_us += 1;
            return None;
        }
        let fresh = self
            .broadcast_rx
            .get(&src)
            .is_some_and(|b| b.epoch == epoch && b.key_id == key_id && b.group == group);
        if !fresh {
            let bytes = kdf::broadcast_key_bytes(fabric_key, group, src, epoch);
            let window = self.broadcast_rx.remove(&src).map(|b| b.window).unwrap_or_default();
            let key = SealKey::new(Suite::Aes256Gcm, &bytes);
            self.broadcast_rx.insert(src, BroadcastRx { epoch, key_id, group, key, window });
        }
        let rx = self.broadcast_rx.get_mut(&src).expect("inserted above");
        if !rx.window.check(counter) {
            self.reject(now, src, Reason::Replay);
            return None;
        }
        // The tag leaves the destination out (see FLAG_BROADCAST_KEY): open a copy with it zero,
        // then give the transport the frame as the port delivered it.
        scratch.clear();
        scratch.extend_from_slice(&frame[..end]);
        scratch[..6].fill(0);
        let opened = if encrypted {
            scratch.extend_from_slice(&tag);
            let (head, rest) = scratch.split_at_mut(HDR);
            rx.key.open(counter, head, rest)
        } else {
            let mut t = tag;
            rx.key.open(counter, scratch, &mut t)
        };
        scratch.truncate(end);
        scratch[..6].copy_from_slice(&frame[..6]);
        let out: Option<&'a [u8]> = if opened { Some(&scratch[..]) } else { None };
        let Some(out) = out else {
            // Keep the window as it was: a forged frame must not move it.
            self.reject(now, src, Reason::BadTag);
            return None;
        };
        rx.window.commit(counter);
        let session_epoch = self.peers.get(&src).and_then(|p| p.current.as_ref()).map(|s| s.peer_epoch);
        match session_epoch {
            Some(e) if e != 0 && e != epoch => {
                self.reject(now, src, Reason::StaleEpoch);
                None
            }
            Some(_) => {
                self.counters.opened += 1;
                Some(out)
            }
            None => {
                // No membership, no liveness before a handshake: a member's broadcast from a node
                // without a session starts one, and its next broadcast is heard.
                self.counters.held_for_handshake += 1;
                self.want_session(now, src);
                None
            }
        }
    }

    fn promote(&mut self, now: Instant, src: MacAddr) {
        let send = self.ring.send_key().id();
        let Some(peer) = self.peers.get_mut(&src) else { return };
        let Some(p) = peer.pending.take() else { return };
        if let Some(old) = peer.current.take() {
            peer.previous = Some((old, now + PREVIOUS_GRACE));
        }
        peer.rekey = p.session.key_id != send;
        peer.current = Some(p.session);
        peer.initiating = None;
        self.counters.sessions_established += 1;
        tracing::debug!("session with {src} established (responder)");
    }

    fn handle_handshake(&mut self, now: Instant, src: MacAddr, header_epoch: u32, body: &[u8]) {
        let Ok(m) = HandshakeRepr::parse(body) else {
            self.reject(now, src, Reason::BadHandshake);
            return;
        };
        let Some(key) = self.handshake_key(m.key_id) else {
            self.reject(now, src, Reason::UnknownKey);
            return;
        };
        if !m.verify(key, src, self.local) || m.own.epoch != header_epoch {
            self.reject(now, src, Reason::BadHandshake);
            return;
        }
        match m.step {
            Step::Hello => self.handle_hello(now, src, m),
            Step::Reply => self.handle_reply(now, src, m),
            Step::Confirm => {
                let fits = self.peers.get(&src).and_then(|p| p.pending.as_ref()).is_some_and(|p| {
                    m.own == p.hello.own && m.peer == p.reply.own && m.key_id == p.reply.key_id
                });
                if fits {
                    self.promote(now, src);
                } else {
                    // From a member (its tag verified), for an offer this node no longer holds:
                    // a newer handshake replaced it, or it expired.
                    self.counters.stale_handshakes += 1;
                }
            }
        }
    }

    fn handle_hello(&mut self, now: Instant, src: MacAddr, m: HandshakeRepr) {
        // A node that has sent nothing yet does not know its epoch: it answers with 0, and the
        // initiator takes the epoch of the first frame sealed under the session (see `open`).
        let local = self.local;
        let Some(peer) = self.peer(src) else { return };
        if peer.initiating.is_some() {
            // Both sides started at once: the lower MAC's handshake goes on.
            if local.0 < src.0 {
                return;
            }
            peer.initiating = None;
        }
        if let Some(p) = &peer.pending {
            if p.hello == m {
                // The initiator did not get the REPLY: send the same one again.
                let frame = p.frame.clone();
                self.outbox.push_back(frame);
                return;
            }
        }
        let avoid: Vec<u32> = peer.current.iter().map(|s| s.local_id).collect();
        let own = self.random_half(&avoid);
        let Some(fabric_key) = self.ring.find(m.key_id).cloned() else { return };
        let params = SessionParams {
            initiator: src,
            responder: local,
            initiator_epoch: m.own.epoch,
            responder_epoch: own.epoch,
            initiator_session: m.own.session,
            responder_session: own.session,
            initiator_nonce: m.own.nonce,
            responder_nonce: own.nonce,
            suite: m.suite,
        };
        let (to_responder, to_initiator) = kdf::session_keys(&fabric_key, &params);
        let session = Session {
            key_id: m.key_id,
            local_id: own.session,
            remote_id: m.own.session,
            peer_epoch: m.own.epoch,
            tx: to_initiator,
            rx: to_responder,
            tx_counter: 0,
            window: ReplayWindow::default(),
        };
        let mut reply = HandshakeRepr {
            step: Step::Reply,
            suite: m.suite,
            key_id: m.key_id,
            own,
            peer: m.own,
            tag: [0; 32],
        };
        let Some(key) = self.handshake_key(m.key_id) else { return };
        reply.sign(key, local, src);
        let frame = self.handshake_frame(src, m.own.epoch, &reply);
        self.outbox.push_back(frame.clone());
        if let Some(peer) = self.peer(src) {
            peer.pending = Some(Pending { session, hello: m, reply, frame, expires: now + PENDING_LIFETIME });
        }
    }

    fn handle_reply(&mut self, now: Instant, src: MacAddr, m: HandshakeRepr) {
        let local = self.local;
        let fits =
            self.peers.get(&src).and_then(|p| p.initiating.as_ref()).is_some_and(|i| {
                m.peer == i.hello.own && m.key_id == i.hello.key_id && m.suite == i.hello.suite
            });
        if !fits {
            // From a member, answering a HELLO this node no longer waits on (sent again, or
            // replaced by a newer handshake), or a replay.
            self.counters.stale_handshakes += 1;
            return;
        }
        let Some(fabric_key) = self.ring.find(m.key_id).cloned() else { return };
        let Some(key) = self.handshake_key(m.key_id).cloned() else { return };
        let send = self.ring.send_key().id();
        let peer = self.peers.get_mut(&src).expect("checked above");
        let hello = peer.initiating.take().expect("checked above").hello;
        let params = SessionParams {
            initiator: local,
            responder: src,
            initiator_epoch: hello.own.epoch,
            responder_epoch: m.own.epoch,
            initiator_session: hello.own.session,
            responder_session: m.own.session,
            initiator_nonce: hello.own.nonce,
            responder_nonce: m.own.nonce,
            suite: m.suite,
        };
        let (to_responder, to_initiator) = kdf::session_keys(&fabric_key, &params);
        if let Some(old) = peer.current.take() {
            peer.previous = Some((old, now + PREVIOUS_GRACE));
        }
        // The newest handshake wins: an offer made before this one is void.
        peer.pending = None;
        peer.current = Some(Session {
            key_id: m.key_id,
            local_id: hello.own.session,
            remote_id: m.own.session,
            peer_epoch: m.own.epoch,
            tx: to_responder,
            rx: to_initiator,
            tx_counter: 0,
            window: ReplayWindow::default(),
        });
        peer.rekey = m.key_id != send;
        self.counters.sessions_established += 1;
        tracing::debug!("session with {src} established (initiator)");
        let mut confirm = HandshakeRepr {
            step: Step::Confirm,
            suite: m.suite,
            key_id: m.key_id,
            own: hello.own,
            peer: m.own,
            tag: [0; 32],
        };
        confirm.sign(&key, local, src);
        let frame = self.handshake_frame(src, m.own.epoch, &confirm);
        self.outbox.push_back(frame);
    }
}

fn derive_handshake_keys(ring: &KeyRing) -> Vec<(KeyId, hmac::Key)> {
    ring.ids().into_iter().filter_map(|id| ring.find(id).map(|k| (id, kdf::handshake_key(k)))).collect()
}

/// Verifies (and decrypts) a sealed frame; `None` if its tag is wrong.
fn open_with<'a>(
    key: &SealKey,
    frame: &'a [u8],
    end: usize,
    counter: u64,
    tag: [u8; TAG_LEN],
    encrypted: bool,
    scratch: &'a mut Vec<u8>,
) -> Option<&'a [u8]> {
    if !encrypted {
        let mut t = tag;
        return key.open(counter, &frame[..end], &mut t).then_some(&frame[..end]);
    }
    scratch.clear();
    scratch.extend_from_slice(&frame[..end]);
    scratch.extend_from_slice(&tag);
    let (head, rest) = scratch.split_at_mut(HDR);
    if !key.open(counter, head, rest) {
        return None;
    }
    scratch.truncate(end);
    Some(&scratch[..])
}
