//! The reliable lanbus transport (transport layer): ordered message channels between MAC addresses
//! over Ethernet, as a sans-IO state machine.
//!
//! Nothing here reads a clock, touches a socket or spawns a thread: the driver passes `now` into
//! every call and moves frames between the core and a port. The same code runs in the daemon and in
//! the simulator. Frames are Ethernet II with EtherType 0x88B5 and the header of
//! [`lanbus_wire::frame`] (`docs/wire.md` draws every byte).
//!
//! # Call order
//!
//! A driver owns one [`Endpoint`] and loops:
//!
//! 1. feed every received frame to [`Endpoint::handle_frame`] (or to
//!    [`Endpoint::handle_frame_delivering`], which lends the frame's messages to a callback at
//!    once, without a copy, whenever order allows: step 3 then finds only the rest);
//! 2. if [`Endpoint::poll_timeout`] is due, call [`Endpoint::handle_timeout`];
//! 3. drain [`Endpoint::poll_message`] and [`Endpoint::poll_event`];
//! 4. queue new messages with [`Endpoint::send`] (it fails with [`SendError::QueueFull`] when the
//!    channel's send queue is full: retry after draining transmits and ACKs);
//! 5. call [`Endpoint::poll_transmit`] until it returns `None` (nothing to send, window full, or
//!    paced out), sending each frame it writes;
//! 6. sleep or spin until [`Endpoint::poll_timeout`] or the next frame.
//!
//! Time never goes back: every `now` passed in must be `>=` the previous one. All polls are
//! `#[must_use]`: a frame written by `poll_transmit` that is not sent is simply lost (the protocol
//! recovers, slowly).
//!
//! # State machine
//!
//! Per (peer MAC, channel id) there is one ordered stream in each direction.
//!
//! *Sender*: messages are segmented by the MTU into frames (several small messages
//! packed into one frame when [`Config::pack_messages`]), queued, and numbered with a wrapping
//! 32-bit [`Seq`]. At most [`Config::window_frames`] frames past the oldest unacknowledged one are
//! ever transmitted. A cumulative ACK `a` releases every frame before `a`. An ACK that does not
//! advance is a duplicate; after exactly [`Config::dup_ack_threshold`] duplicates the sender goes
//! back to the first unacknowledged frame and resends from there (fast retransmit). A duplicate
//! counts only if it echoes the timestamp of a frame sent no earlier than the latest transmission
//! of that first unacknowledged frame: duplicates answering older frames (the receiver's answers
//! to a go-back's resends of frames it already had) carry no news of a loss, and counting them
//! would start go-back after go-back; a duplicate answering a later frame means the resend itself
//! was lost, and fast retransmit fires again without waiting for the timer.
//! When the retransmission timer (RFC 6298 RTO from the smoothed RTT, bounded, doubled on every
//! expiry) fires, it also goes back. RTT samples come from timestamps the receiver echoes, so
//! every sample belongs to exactly one transmission and Karn's rule (ignore samples of
//! retransmitted frames) is unnecessary: a retransmission carries a fresh timestamp, and the echo
//! says which copy was answered (as RFC 7323 §4 argues for TCP timestamps).
//!
//! With [`Config::tail_loss_probe`], when no ACK came for two smoothed round trips (plus the
//! ACK delay) while frames are in flight, the oldest unacknowledged frame goes once more before
//! the timer: the receiver's answer to it (an advancing or a duplicate ACK) moves the sender on
//! within a round trip, so a lost last frame no longer waits for the RTO.
//!
//! *Selective repeat* ([`Config::selective_repeat`], on by default): the receiver holds DATA
//! frames that arrive past a hole (up to 256, within its receive backlog) and every ACK frame it
//! sends meanwhile carries a bitmap of them ([`Sack`]). The sender does not send held frames again
//! and takes a frame for lost when frames sent no earlier than it are held past it (the duplicate
//! ACK threshold of them, or all sent after it if fewer); only lost frames go again, before new
//! ones. A timeout forgets the reports and goes back as above. Go-Back-N (the setting off) is the
//! retransmission paper's scheme, which the simulator's reproduction of it keeps.
//!
//! *Receiver*: delivers frames in sequence order only. Any DATA frame other than the next expected
//! one is held (selective repeat) or dropped (counted as out of order or duplicate), and answered
//! at once with a duplicate ACK, always in an ACK frame of its own (never carried on DATA: the
//! sender counts only ACK frames).
//! Accepted frames are acknowledged every [`Config::ack_every_frames`] frames or after
//! [`Config::ack_delay`], whichever comes first.
//!
//! *Rate control* ([`RateConfig`], Timely/Swift spirit): each channel paces its frames at a rate
//! that is cut multiplicatively when the fabric's RTT (the RTT less the time the receiver says it
//! held the frame before acknowledging it, as Swift separates fabric and host delay) exceeds the
//! minimum RTT plus a target queueing delay
//! and raised additively when it is below (held while the RTT is above target but falling, as
//! Timely's gradient does); a channel also keeps at most `rate * (min RTT + target delay)` bytes in
//! flight (Swift's window), so a growing queue slows it through the ACK clock before any cut takes
//! effect. `poll_transmit` returns `None` while paced out or window-limited.
//!
//! *Restarts*: every frame carries its sender's epoch (one per incarnation, [`Config::epoch`]) and
//! the receiver's epoch as the sender knows it. A peer heard with a new epoch has restarted:
//! both sides start every channel with it afresh and the application gets
//! [`Event::PeerRestarted`]. Frames from a peer's earlier incarnation, and frames meant for an
//! earlier incarnation of ours, are dropped (the latter answered with an ACK frame that carries
//! our epoch, so the peer learns of our restart at once).
//!
//! *Heartbeats* ([`HeartbeatConfig`]): each endpoint broadcasts its role, name and group; a peer
//! table reports [`Event`]s. Any valid frame from a peer (DATA, ACK or heartbeat) is a sign of
//! life: a peer is down only when nothing at all arrived from it for K of its heartbeat
//! intervals, so a peer too busy to be heard between its data frames is never taken for dead. DATA and ACK frames whose
//! header group differs from the local group are dropped and counted; with heartbeats enabled,
//! DATA and ACK frames from a MAC never heard in a heartbeat are dropped too.
//!
//! # Threads
//!
//! [`Endpoint::split`] gives a [`SendHalf`] (segmentation, window, pacing, retransmission, ACK and
//! heartbeat transmission) and a [`ReceiveHalf`] (validation, ordering, delivery, ACK generation,
//! peer table) that may live on different threads: the receive half produces [`Feedback`] values
//! that the driver moves (through any queue) into [`SendHalf::handle_feedback`]. `Endpoint` is
//! exactly the two halves with the queue replaced by a direct call.
#![deny(unsafe_code)]
#![deny(missing_docs)]

mod config;
mod counters;
mod endpoint;
mod map;
#[cfg(test)]
mod peer_tests;
mod rate;
mod recv;
mod rtt;
mod send;
mod seq;
#[cfg(test)]
mod sr_tests;
#[cfg(test)]
mod star_tests;
#[cfg(test)]
mod tests;
#[cfg(any(test, feature = "testing"))]
pub mod testutil;

use lanbus_wire::{Instant, MacAddr};

pub use config::{Config, HeartbeatConfig, RateConfig, PAPER_DUP_ACK_THRESHOLD};
pub use counters::Counters;
pub use endpoint::Endpoint;
pub use lanbus_wire::frame::{Role, Sack};
pub use recv::{Message, ReceiveHalf};
pub use send::{FrameRef, Gathered, Lend, LentSlice, MessageSource, SendHalf};
pub use seq::Seq;

/// Why [`Endpoint::send`] refused a message. Nothing was queued in either case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// The channel's send queue ([`Config::send_queue_frames`]) is full: transmit, let ACKs
    /// arrive, and try again.
    #[error("send queue full: drain poll_transmit and retry")]
    QueueFull,
    /// The message is longer than 64 KiB.
    #[error("message of {len} bytes exceeds the 65536-byte limit")]
    TooLarge {
        /// The message's length.
        len: usize,
    },
    /// The destination is a broadcast or multicast address; channels are point to point.
    #[error("destination {0} is not a unicast MAC address")]
    NotUnicast(MacAddr),
}

/// Something the application may want to know about peers.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A peer was heard for the first time (or again after it went down).
    PeerUp {
        /// Its MAC address.
        peer: MacAddr,
        /// Its role.
        role: Role,
        /// Its group.
        group: u16,
        /// Its name.
        name: String,
    },
    /// Nothing at all (no DATA, ACK or heartbeat) arrived from a peer for
    /// [`HeartbeatConfig::missed_limit`] of its heartbeat intervals.
    PeerDown {
        /// Its MAC address.
        peer: MacAddr,
    },
    /// A peer came back with a new epoch: it restarted (with the same MAC). Every channel with it
    /// started afresh on both sides; messages queued for or partly received from its earlier
    /// incarnation are gone. A peer table entry stays as it was (no `PeerDown`/`PeerUp`).
    PeerRestarted {
        /// Its MAC address.
        peer: MacAddr,
        /// Its new epoch.
        epoch: u32,
    },
    /// A live peer announced a different group.
    GroupChanged {
        /// Its MAC address.
        peer: MacAddr,
        /// The group it had.
        old: u16,
        /// The group it has now.
        new: u16,
    },
}

/// A value the [`ReceiveHalf`] hands to the [`SendHalf`] (through a queue the driver moves, or
/// directly inside [`Endpoint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feedback {
    /// An ACK arrived for data this endpoint sent.
    AckReceived {
        /// The peer that acknowledged.
        peer: MacAddr,
        /// The channel.
        channel: u16,
        /// The next sequence the peer expects.
        ack: Seq,
        /// The timestamp of ours that the ACK echoes (ns, truncated to 32 bits).
        echo_ns: Option<u32>,
        /// How long the peer held the echoed frame before this ACK left it (its own delay, which
        /// rate control leaves out of the fabric's), ns.
        hold_ns: u64,
        /// The frames past `ack` the peer holds (selective repeat; empty otherwise).
        sack: Sack,
    },
    /// A DATA frame from the peer carried an ACK for data this endpoint sent (a piggybacked
    /// ACK): it advances the window like [`Feedback::AckReceived`] but never counts as a
    /// duplicate ACK.
    AckCarried {
        /// The peer that acknowledged.
        peer: MacAddr,
        /// The channel.
        channel: u16,
        /// The next sequence the peer expects.
        ack: Seq,
        /// The timestamp of ours that the ACK echoes (ns, truncated to 32 bits).
        echo_ns: Option<u32>,
        /// How long the peer held the echoed frame before this ACK left it (its own delay, which
        /// rate control leaves out of the fabric's), ns.
        hold_ns: u64,
    },
    /// The receiver accepted DATA from a peer and owes it this ACK, which it will send on its own
    /// once enough frames arrived or the ACK delay is over; until then the sending half may carry
    /// it on a DATA frame to that peer and channel (and then skips the same ACK when it comes as
    /// [`Feedback::SendAck`]).
    AckOwed {
        /// The peer to acknowledge.
        peer: MacAddr,
        /// The channel.
        channel: u16,
        /// The next sequence expected from the peer.
        ack: Seq,
        /// The peer's timestamp to echo back (ns, truncated).
        echo_ns: Option<u32>,
        /// When the frame whose timestamp is echoed arrived: the ACK reports how long it held it.
        received: Instant,
    },
    /// The receiver wants an ACK sent to a peer. If it advances beyond every ACK sent or owed
    /// on the channel, a DATA frame written at once may carry it instead of an ACK frame.
    SendAck {
        /// The peer to acknowledge.
        peer: MacAddr,
        /// The channel.
        channel: u16,
        /// The next sequence expected from the peer.
        ack: Seq,
        /// The peer's timestamp to echo back (ns, truncated).
        echo_ns: Option<u32>,
        /// When the frame whose timestamp is echoed arrived: the ACK reports how long it held it.
        received: Instant,
        /// Frames past `ack` held (selective repeat): a non-empty report always goes in an ACK
        /// frame of its own.
        sack: Sack,
    },
    /// The receiver heard a peer's epoch for the first time: frames to it carry it from now on.
    PeerEpoch {
        /// The peer.
        peer: MacAddr,
        /// Its epoch.
        epoch: u32,
    },
    /// The receiver saw a peer come back with a new epoch (it restarted): the sending half drops
    /// everything queued or in flight to it and starts its channels afresh.
    PeerRestarted {
        /// The peer.
        peer: MacAddr,
        /// Its new epoch.
        epoch: u32,
    },
    /// The receiver held or discarded an out-of-order or already-received DATA frame and wants a
    /// duplicate ACK sent at once: always in an ACK frame of its own, never carried on DATA nor
    /// merged with another ACK, since the peer counts only ACK frames toward fast retransmit.
    SendDuplicateAck {
        /// The peer to acknowledge.
        peer: MacAddr,
        /// The channel.
        channel: u16,
        /// The next sequence expected from the peer.
        ack: Seq,
        /// The timestamp of the discarded frame, to echo back (ns, truncated).
        echo_ns: Option<u32>,
        /// When the discarded frame arrived.
        received: Instant,
        /// Frames past `ack` held (selective repeat).
        sack: Sack,
    },
}

/// The 32-bit truncated nanosecond timestamp frames carry.
fn stamp(now: lanbus_wire::Instant) -> u32 {
    now.as_nanos() as u32
}
