//! The sending half (transport layer): segmentation and packing, the window, fast retransmit
//! (Go-Back-N, or selective repeat), the retransmission timer, pacing, and transmission of ACKs
//! and heartbeats.
//!
//! Per channel the frames live in one queue: `frames[0]` carries sequence `base` (the oldest
//! unacknowledged), `frames[..high]` have been transmitted at least once (sealed: nothing more is
//! packed into them), `frames[high..]` are queued, and `next` is the index the next transmission
//! in order takes (it goes back to 0 on a Go-Back-N fast retransmit or a timeout). Invariants:
//! `next <= high <= frames.len()`, `next < window` whenever a DATA frame is written, and an ACK
//! only advances `base` up to `base + high` (the frames actually sent).
//!
//! With selective repeat each frame also has marks (`marks[i]` for `frames[i]`): `SACKED`, the
//! receiver holds it past a hole; `LOST`, a frame sent no earlier than it was acknowledged past it,
//! so it goes again before anything new. `inflight_bytes` counts the frames of `frames[..next]`
//! with neither mark. A timeout clears every mark (the receiver may have let go of what it held)
//! and goes back like Go-Back-N; sending in order then skips frames acknowledged meanwhile.
//!
//! A frame may end in lent bytes (`bodies[i]`, parallel to `frames`): a message queued with
//! [`SendHalf::send_lent`] keeps its payload where its sender has it, and each frame holds its
//! headers and a slice of that memory (a reference to it, released when the frame is
//! acknowledged or dropped). Nothing is packed after lent bytes.

use std::collections::VecDeque;
use std::sync::Arc;

use lanbus_wire::ethernet::{EtherType, EthernetFrame, EthernetRepr, HEADER_LEN as ETH_LEN};
use lanbus_wire::frame::{
    self, HeartbeatRepr, Kind, Packet, Repr, FLAG_ACK, FLAG_ECHO, FLAG_SACK, HEADER_LEN as LB_LEN,
    MAX_MESSAGE_LEN, RECORD_FIRST, RECORD_HEADER_LEN, RECORD_LAST,
};
use lanbus_wire::{Instant, MacAddr};

use crate::map::{key, ChannelMap};
use crate::rate::RateControl;
use crate::rtt::RttEstimator;
use crate::{stamp, Config, Counters, Feedback, Sack, SendError, Seq};

/// The lanbus header of a stored frame (which this half wrote: it holds a whole header).
fn header(frame: &[u8]) -> Packet<&[u8]> {
    Packet::new_unchecked(&frame[ETH_LEN..])
}

/// The lanbus header of a stored frame or of a frame being written, for patching fields.
fn header_mut(frame: &mut [u8]) -> Packet<&mut [u8]> {
    Packet::new_unchecked(&mut frame[ETH_LEN..])
}

/// A frame [`SendHalf::poll_transmit_ref`] wrote, where it lies: read it with
/// [`SendHalf::frame`] and hand it to the port as it is, without a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameRef(FrameAt);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FrameAt {
    /// A DATA frame in the queue of channel `ci`, where it stays until acknowledged.
    Stored { ci: usize, index: usize },
    /// An ACK or heartbeat frame in the half's own buffer `i`.
    Scratch(usize),
}

/// How long since `received`, in the microseconds an ACK reports (saturating).
fn hold_us(now: Instant, received: Instant) -> u16 {
    let us = (now.saturating_duration_since(received).as_nanos() + 500) / 1000;
    u16::try_from(us).unwrap_or(u16::MAX)
}

/// When a tail-loss probe for a flight sent or acknowledged at `now` fires: two smoothed round
/// trips plus the receiver's ACK delay, or `srtt + 4 * rttvar` if later, if that comes before the
/// retransmission timer (and the channel has an RTT sample to go by; before one, the RTO alone
/// serves).
fn probe_at(config: &Config, ch: &TxChannel, now: Instant) -> Option<Instant> {
    if !config.tail_loss_probe {
        return None;
    }
    let srtt = core::time::Duration::from_nanos(ch.rtt.srtt()?);
    // Two round trips, or more where they vary more than that (hosts whose threads share the
    // cores answer late now and then): a probe sent while the answer is merely late is a
    // frame and a duplicate ACK wasted. Still before the RTO, whose floor is far above.
    let variation = core::time::Duration::from_nanos(ch.rtt.variation_bound().unwrap_or(0));
    let pto = (srtt * 2 + config.ack_delay).max(variation);
    (pto < ch.rtt.rto()).then(|| now + pto)
}

/// A large message does not start in a queued frame with less room than this.
const MIN_SPLIT_ROOM: usize = 256;

/// Frame mark (selective repeat): the receiver holds the frame past a hole.
const SACKED: u8 = 1;
/// Frame mark (selective repeat): the frame was lost and goes again before new frames.
const LOST: u8 = 2;

struct TxChannel {
    peer: MacAddr,
    channel: u16,
    frames: VecDeque<Vec<u8>>,
    /// The lent bytes each frame ends with, if any (see the module's docs), parallel to `frames`.
    bodies: VecDeque<Option<LentSlice>>,
    /// Selective repeat's marks of each frame ([`SACKED`], [`LOST`]), parallel to `frames`.
    marks: VecDeque<u8>,
    /// Frames marked [`LOST`].
    lost: usize,
    base: Seq,
    next: usize,
    high: usize,
    dup_acks: u32,
    rto_deadline: Option<Instant>,
    /// When a tail-loss probe fires, while frames are in flight and no probe was sent since the
    /// last ACK progress.
    probe_deadline: Option<Instant>,
    /// A probe went since the last ACK progress (one per flight: after it, the RTO).
    probed: bool,
    /// A probe is due to be written by `poll_transmit`.
    probe_pending: bool,
    rtt: RttEstimator,
    rate: RateControl,
    /// Bytes of `frames[..next]`: sent in this round and not acknowledged.
    inflight_bytes: usize,
    /// The ACK (and echo) the receive half owes the peer on this channel, which the next DATA
    /// frame carries ([`Feedback::AckOwed`], or a due [`Feedback::SendAck`] whose carrier is
    /// written in the same `poll_transmit`).
    owed: Option<(Seq, Option<u32>, Instant)>,
    /// The last ACK a DATA frame carried: the same ACK coming later as [`Feedback::SendAck`]
    /// (the coalescing timer firing) is not sent again.
    carried: Option<(Seq, Option<u32>)>,
    /// The newest ACK this half sent the peer on this channel (in an ACK frame or carried).
    last_acked: Option<Seq>,
    /// The peer's epoch as this half knows it (0: not yet), stamped on every frame.
    peer_epoch: u32,
}

impl TxChannel {
    /// Bytes of frame `i`, lent ones included.
    fn frame_len(&self, i: usize) -> usize {
        self.frames[i].len() + self.bodies[i].as_ref().map_or(0, LentSlice::len)
    }

    /// The frame to send next, if any: the oldest frame marked lost, else the next in order
    /// within the window.
    fn candidate(&self, window: usize) -> Option<usize> {
        if self.lost > 0 {
            return self.marks.iter().position(|m| m & LOST != 0);
        }
        (self.next < self.frames.len() && self.next < window).then_some(self.next)
    }

    fn has_sendable(&self, window: usize) -> bool {
        self.candidate(window)
            .is_some_and(|i| self.rate.window_allows(self.inflight_bytes, self.frame_len(i)))
    }

    /// Moves `next` past frames the receiver already holds (after a go-back).
    fn skip_sacked(&mut self) {
        while self.next < self.high && self.marks[self.next] & SACKED != 0 {
            self.next += 1;
        }
    }

    /// Applies a selective acknowledgement (bit `k`: the frame after `base` by `k + 1`): marks
    /// the frames held, then finds the frames lost. A frame in flight is lost when frames after
    /// it, sent no earlier than it, are held: at least `threshold` of them, or all that were
    /// sent after it if fewer (a lost frame's resend is thus found lost again, and an early
    /// report never retires a resend still on its way). Returns how many were found lost.
    fn apply_sack(&mut self, sack: &Sack, threshold: usize) -> usize {
        for k in sack.iter() {
            let i = k + 1;
            if i >= self.high {
                break;
            }
            let m = self.marks[i];
            if m & SACKED != 0 {
                continue;
            }
            if m & LOST != 0 {
                self.lost -= 1;
            } else if i < self.next {
                self.inflight_bytes -= self.frame_len(i);
            }
            self.marks[i] = SACKED;
        }
        self.skip_sacked();
        let mut found = 0;
        let mut held_after = 0usize;
        let mut newest_held: Option<u32> = None;
        for i in (0..self.high).rev() {
            let m = self.marks[i];
            let sent = header(&self.frames[i]).timestamp();
            if m & SACKED != 0 {
                held_after += 1;
                newest_held = Some(match newest_held {
                    Some(t) if t.wrapping_sub(sent) as i32 >= 0 => t,
                    _ => sent,
                });
                continue;
            }
            let enough = held_after > 0 && held_after >= threshold.min(self.high - 1 - i);
            let later = newest_held.is_some_and(|t| t.wrapping_sub(sent) as i32 >= 0);
            if i < self.next && m & LOST == 0 && enough && later {
                self.marks[i] |= LOST;
                self.lost += 1;
                self.inflight_bytes -= self.frame_len(i);
                found += 1;
            }
        }
        found
    }

    /// Notes that `ack` went to the peer (in an ACK frame or carried): `last_acked` only moves
    /// forward.
    fn note_acked(&mut self, ack: Seq) {
        self.last_acked = Some(match self.last_acked {
            Some(last) if ack.is_before(last) => last,
            _ => ack,
        });
    }

    /// Go back to the first unacknowledged frame (and forget the receiver's reports: it may
    /// have let go of what it held).
    fn go_back(&mut self) {
        self.dup_acks = 0;
        self.next = 0;
        self.inflight_bytes = 0;
        self.marks.iter_mut().for_each(|m| *m = 0);
        self.lost = 0;
    }
}

#[derive(Debug, Clone, Copy)]
struct AckDue {
    peer: MacAddr,
    channel: u16,
    ack: Seq,
    echo_ns: Option<u32>,
    /// When the echoed frame arrived (the ACK reports how long it was held).
    received: Instant,
    /// A duplicate ACK ([`Feedback::SendDuplicateAck`]): always an ACK frame of its own.
    duplicate: bool,
    /// Frames held past `ack` (selective repeat): reported only in an ACK frame.
    sack: Sack,
}

/// The sending half of an [`Endpoint`](crate::Endpoint): owns everything that writes frames.
///
/// Call order as for `Endpoint`: [`SendHalf::send`], [`SendHalf::handle_feedback`] with each
/// value from [`ReceiveHalf::poll_feedback`](crate::ReceiveHalf::poll_feedback),
/// [`SendHalf::handle_timeout`] when [`SendHalf::poll_timeout`] is due, and
/// [`SendHalf::poll_transmit`] until `None`. Time never goes back.
pub struct SendHalf {
    config: Config,
    local: MacAddr,
    group: u16,
    channels: Vec<TxChannel>,
    index: ChannelMap,
    last: Option<(u64, usize)>,
    pool: Vec<Vec<u8>>,
    acks: VecDeque<AckDue>,
    next_heartbeat: Option<Instant>,
    rr: usize,
    /// Channels with a tail-loss probe to write.
    probes_pending: usize,
    /// This incarnation's epoch.
    epoch: u32,
    /// Every peer's epoch as the receive half learnt it.
    peer_epochs: std::collections::HashMap<MacAddr, u32>,
    counters: Counters,
    window: usize,
    /// The latest owed ACK of a channel this half has not sent on yet (channel key, ACK, echo):
    /// a first reply carries the ACK of its request too.
    owed_unopened: Option<(u64, Seq, Option<u32>, Instant)>,
    /// The stamp of the first DATA frame written since the driver last said its frames left.
    unflushed_since: Option<u32>,
    /// The ACK the last DATA frame written carried, for the receiving half of a whole endpoint
    /// (see [`SendHalf::take_carried`]).
    last_carried: Option<(MacAddr, u16, Seq)>,
    /// The latest bursts that left (first frame's stamp, stamp when they left), a ring.
    flushes: [(u32, u32); FLUSHES],
    /// Where the next burst goes in `flushes`.
    flush_at: usize,
    /// Buffers of whole frame capacity for ACK and heartbeat frames that
    /// [`SendHalf::poll_transmit_ref`] wrote, with their lengths; the first `scratch_used` hold
    /// frames not yet known to have left.
    scratch: Vec<(Box<[u8]>, usize)>,
    scratch_used: usize,
}

/// Bursts remembered by [`SendHalf::frames_left`]: ACKs answer recent frames.
const FLUSHES: usize = 16;

impl SendHalf {
    pub(crate) fn new(config: Config, local: MacAddr, now: Instant) -> Self {
        let window = config.window_frames.max(1) as usize;
        let epoch = config.epoch.max(1);
        SendHalf {
            group: config.group,
            next_heartbeat: config.heartbeat.enabled.then_some(now),
            config,
            local,
            channels: Vec::new(),
            index: ChannelMap::default(),
            last: None,
            pool: Vec::new(),
            acks: VecDeque::new(),
            rr: 0,
            probes_pending: 0,
            epoch,
            peer_epochs: std::collections::HashMap::new(),
            counters: Counters::default(),
            window,
            owed_unopened: None,
            unflushed_since: None,
            last_carried: None,
            flushes: [(0, 0); FLUSHES],
            flush_at: 0,
            scratch: Vec::new(),
            scratch_used: 0,
        }
    }

    /// What this half counted (frames sent, retransmissions, timeouts, RTT...).
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// How many messages were queued so far (the `messages_sent` counter, without copying the
    /// rest): a caller that skips work when nothing changed compares it before and after.
    #[must_use]
    pub fn messages_queued(&self) -> u64 {
        self.counters.messages_sent
    }

    /// Changes the group stamped on every frame from now on (heartbeats announce it at once).
    pub fn set_group(&mut self, group: u16, now: Instant) {
        self.group = group;
        if self.config.heartbeat.enabled {
            self.next_heartbeat = Some(now);
        }
    }

    /// The local group.
    pub fn group(&self) -> u16 {
        self.group
    }

    /// Frames queued or in flight to `peer` on `channel` (0 if the channel is unknown).
    pub fn queued_frames(&self, peer: MacAddr, channel: u16) -> usize {
        self.index.get(&key(peer, channel)).map_or(0, |&i| self.channels[i].frames.len())
    }

    /// Whether every message sent has been acknowledged.
    pub fn is_idle(&self) -> bool {
        self.channels.iter().all(|c| c.frames.is_empty()) && self.acks.is_empty()
    }

    /// The current rate of a channel in bits per second (`None` if unknown or rate control is
    /// off).
    pub fn pacing_rate_bps(&self, peer: MacAddr, channel: u16) -> Option<f64> {
        let c = &self.channels[*self.index.get(&key(peer, channel))?];
        c.rate.enabled().then(|| c.rate.rate_bps())
    }

    fn channel_index(&mut self, peer: MacAddr, channel: u16) -> usize {
        let k = key(peer, channel);
        if let Some((lk, li)) = self.last {
            if lk == k {
                return li;
            }
        }
        let i = match self.index.get(&k) {
            Some(&i) => i,
            None => {
                let i = self.channels.len();
                self.channels.push(TxChannel {
                    peer,
                    channel,
                    frames: VecDeque::new(),
                    bodies: VecDeque::new(),
                    marks: VecDeque::new(),
                    lost: 0,
                    base: Seq(self.config.initial_sequence),
                    next: 0,
                    high: 0,
                    dup_acks: 0,
                    rto_deadline: None,
                    probe_deadline: None,
                    probed: false,
                    probe_pending: false,
                    rtt: RttEstimator::new(self.config.initial_rto, self.config.min_rto, self.config.max_rto),
                    rate: RateControl::new(&self.config.rate, self.config.mtu),
                    inflight_bytes: 0,
                    owed: self
                        .owed_unopened
                        .take_if(|(owed_key, ..)| *owed_key == k)
                        .map(|(_, ack, echo, received)| (ack, echo, received)),
                    carried: None,
                    last_acked: None,
                    peer_epoch: self.peer_epochs.get(&peer).copied().unwrap_or(0),
                });
                self.index.insert(k, i);
                i
            }
        };
        self.last = Some((k, i));
        i
    }

    /// Queues one message (at most 64 KiB) for `peer` on `channel`. All or nothing: on error
    /// nothing is queued. Does not transmit: call [`SendHalf::poll_transmit`].
    pub fn send(&mut self, now: Instant, peer: MacAddr, channel: u16, data: &[u8]) -> Result<(), SendError> {
        self.send_parts(now, peer, channel, &[data])
    }

    /// Queues one message made of `parts` one after the other (a header and a body that live
    /// apart are copied once, straight into the frames); as [`SendHalf::send`] otherwise.
    pub fn send_parts(
        &mut self,
        now: Instant,
        peer: MacAddr,
        channel: u16,
        parts: &[&[u8]],
    ) -> Result<(), SendError> {
        self.send_from(now, peer, channel, &mut Parts(parts))
    }

    /// Queues one message whose bytes `data` appends to the frames itself (bytes that live
    /// elsewhere are copied once, straight into the frames); as [`SendHalf::send`] otherwise.
    /// On error `data` was not read.
    pub fn send_from(
        &mut self,
        _now: Instant,
        peer: MacAddr,
        channel: u16,
        data: &mut dyn MessageSource,
    ) -> Result<(), SendError> {
        let len = data.len();
        if len > MAX_MESSAGE_LEN {
            return Err(SendError::TooLarge { len });
        }
        if peer.is_multicast() {
            return Err(SendError::NotUnicast(peer));
        }
        let max_payload = self.config.max_payload();
        let max_fragment = max_payload - RECORD_HEADER_LEN;
        let limit = self.config.send_queue_frames.max(1);
        let pack = self.config.pack_messages;
        let local = self.local;
        let ci = self.channel_index(peer, channel);
        let ch = &mut self.channels[ci];

        // Room left in the last queued (unsealed) frame.
        let tail_room = match ch.frames.back() {
            Some(f) if pack && ch.frames.len() > ch.high && ch.bodies.back().is_some_and(Option::is_none) => {
                max_payload - (f.len() - ETH_LEN - LB_LEN)
            }
            _ => 0,
        };
        let whole = RECORD_HEADER_LEN + len;
        let into_tail = if whole <= tail_room {
            whole
        } else if len > max_fragment && tail_room >= MIN_SPLIT_ROOM {
            tail_room
        } else {
            0
        };
        let rest = len - into_tail.saturating_sub(RECORD_HEADER_LEN).min(len);
        let new_frames = if into_tail == whole { 0 } else { rest.div_ceil(max_fragment).max(1) };
        if ch.frames.len() + new_frames > limit {
            return Err(SendError::QueueFull);
        }

        let mut off = 0;
        let mut first = true;
        if into_tail > 0 {
            let n = into_tail - RECORD_HEADER_LEN;
            let flags = RECORD_FIRST | if n == len { RECORD_LAST } else { 0 };
            let f = ch.frames.back_mut().expect("tail room implies a tail frame");
            append_record(f, flags, data, 0, n);
            off = n;
            first = false;
        }
        while off < len || first {
            let n = (len - off).min(max_fragment);
            let mut flags = if first { RECORD_FIRST } else { 0 };
            if off + n == len {
                flags |= RECORD_LAST;
            }
            let seq = ch.base + ch.frames.len() as u32;
            let mut f = self.pool.pop().unwrap_or_default();
            start_frame(&mut f, local, ch.peer, ch.channel, seq);
            append_record(&mut f, flags, data, off, n);
            ch.frames.push_back(f);
            ch.bodies.push_back(None);
            ch.marks.push_back(0);
            off += n;
            first = false;
        }
        self.counters.messages_sent += 1;
        self.counters.bytes_sent += len as u64;
        Ok(())
    }

    /// Queues one message made of `head` and then `body`, whose bytes stay where their sender
    /// keeps them: `head` is copied into the first frame, and each frame then ends in a slice of
    /// `body`, which it holds until the frame is acknowledged (or dropped with its peer's
    /// channels). The sender learns that the transport let go of its memory when it holds the
    /// last reference to it again. Nothing is packed before or after such a message; as
    /// [`SendHalf::send`] otherwise.
    pub fn send_lent(
        &mut self,
        _now: Instant,
        peer: MacAddr,
        channel: u16,
        head: &[u8],
        body: LentSlice,
    ) -> Result<(), SendError> {
        let len = head.len() + body.len();
        if len > MAX_MESSAGE_LEN {
            return Err(SendError::TooLarge { len });
        }
        if peer.is_multicast() {
            return Err(SendError::NotUnicast(peer));
        }
        let max_fragment = self.config.max_payload() - RECORD_HEADER_LEN;
        let local = self.local;
        let limit = self.config.send_queue_frames.max(1);
        let ci = self.channel_index(peer, channel);
        let ch = &mut self.channels[ci];
        if ch.frames.len() + len.div_ceil(max_fragment).max(1) > limit {
            return Err(SendError::QueueFull);
        }
        let mut off = 0;
        while off < len || off == 0 {
            let n = (len - off).min(max_fragment);
            let mut flags = if off == 0 { RECORD_FIRST } else { 0 };
            if off + n == len {
                flags |= RECORD_LAST;
            }
            let seq = ch.base + ch.frames.len() as u32;
            let mut f = self.pool.pop().unwrap_or_default();
            start_frame(&mut f, local, ch.peer, ch.channel, seq);
            // The part of `head` in this fragment is copied, the part of `body` lent.
            let copied = head.len().saturating_sub(off).min(n);
            push_record_header(&mut f, flags, n);
            f.extend_from_slice(&head[off.min(head.len())..][..copied]);
            let lent_at = (off + copied).saturating_sub(head.len());
            let lent = body.slice(lent_at..lent_at + (n - copied));
            let plen = (f.len() + lent.len() - ETH_LEN - LB_LEN) as u16;
            header_mut(&mut f).set_payload_len(plen);
            ch.frames.push_back(f);
            ch.bodies.push_back((!lent.is_empty()).then_some(lent));
            ch.marks.push_back(0);
            off += n;
            if n == 0 {
                break;
            }
        }
        self.counters.messages_sent += 1;
        self.counters.bytes_sent += len as u64;
        self.counters.bytes_lent += body.len() as u64;
        Ok(())
    }

    /// The ACK the DATA frame written last carried, if it carried one (taken: a second call
    /// says `None`). A whole [`crate::Endpoint`] tells its receiving half, which then owes no
    /// ACK frame for what it covers.
    pub fn take_carried(&mut self) -> Option<(MacAddr, u16, Seq)> {
        self.last_carried.take()
    }

    /// Takes one value from the receive half: an ACK that arrived, or an ACK to send.
    pub fn handle_feedback(&mut self, now: Instant, feedback: Feedback) {
        match feedback {
            Feedback::SendAck { peer, channel, ack, echo_ns, received, sack } => {
                if let Some(ch) = self.existing_channel(peer, channel) {
                    if sack.is_empty() && ch.carried == Some((ack, echo_ns)) {
                        // A DATA frame already carried exactly this ACK.
                        return;
                    }
                }
                self.acks.push_back(AckDue { peer, channel, ack, echo_ns, received, duplicate: false, sack });
            }
            Feedback::SendDuplicateAck { peer, channel, ack, echo_ns, received, sack } => {
                // Never skipped, even when equal to a carried ACK: frames of one burst share
                // a timestamp, so a duplicate can echo exactly what a DATA frame carried.
                self.acks.push_back(AckDue { peer, channel, ack, echo_ns, received, duplicate: true, sack });
            }
            Feedback::AckOwed { peer, channel, ack, echo_ns, received } => {
                match self.existing_channel(peer, channel) {
                    Some(ch) => ch.owed = Some((ack, echo_ns, received)),
                    None => self.owed_unopened = Some((key(peer, channel), ack, echo_ns, received)),
                }
            }
            Feedback::AckReceived { peer, channel, ack, echo_ns, hold_ns, sack } => {
                self.on_ack(now, peer, channel, ack, echo_ns.map(|e| (e, hold_ns)), &sack, false)
            }
            Feedback::AckCarried { peer, channel, ack, echo_ns, hold_ns } => {
                self.on_ack(now, peer, channel, ack, echo_ns.map(|e| (e, hold_ns)), &Sack::EMPTY, true)
            }
            Feedback::PeerEpoch { peer, epoch } => self.learn_epoch(peer, epoch),
            Feedback::PeerRestarted { peer, epoch } => {
                self.learn_epoch(peer, epoch);
                self.restart_peer(peer);
            }
        }
    }

    /// Notes `peer`'s epoch: frames to it carry it from now on.
    fn learn_epoch(&mut self, peer: MacAddr, epoch: u32) {
        self.peer_epochs.insert(peer, epoch);
        for ch in self.channels.iter_mut().filter(|c| c.peer == peer) {
            ch.peer_epoch = epoch;
        }
    }

    /// Sends every frame in flight to `peer` again, before new ones, without waiting for a
    /// timer: a path of several that carried some of them has failed (the layer below says so),
    /// and the frames it lost are found at once instead of one round trip or a timeout later.
    /// Frames the receiver reported holding are not sent again. Under Go-Back-N the channel
    /// goes back to its first unacknowledged frame.
    pub fn resend_in_flight(&mut self, peer: MacAddr) {
        let selective = self.config.selective_repeat;
        for ch in self.channels.iter_mut().filter(|c| c.peer == peer) {
            if !selective {
                if ch.next > 0 {
                    ch.go_back();
                }
                continue;
            }
            for i in 0..ch.next {
                if ch.marks[i] & (SACKED | LOST) == 0 {
                    ch.marks[i] |= LOST;
                    ch.lost += 1;
                    ch.inflight_bytes -= ch.frame_len(i);
                    self.counters.path_resends += 1;
                }
            }
        }
    }

    /// Gives up on `peer`: whatever was queued or in flight to it is dropped (lent memory let
    /// go of) and its channels start again at the initial sequence, as when it restarts. For a
    /// peer that went down and whose messages nobody waits for any more; one that was only cut
    /// off for a while and comes back with the same epoch sees the new sequence as old
    /// duplicates until it restarts.
    pub fn abandon_peer(&mut self, peer: MacAddr) {
        self.restart_peer(peer);
    }

    /// `peer` restarted: whatever was queued or in flight to it, and the ACKs owed it, are
    /// dropped, and its channels start again at the initial sequence.
    fn restart_peer(&mut self, peer: MacAddr) {
        let initial = Seq(self.config.initial_sequence);
        for ch in self.channels.iter_mut().filter(|c| c.peer == peer) {
            self.pool.extend(ch.frames.drain(..).map(|mut f| {
                f.clear();
                f
            }));
            ch.bodies.clear();
            ch.marks.clear();
            ch.lost = 0;
            ch.base = initial;
            ch.next = 0;
            ch.high = 0;
            ch.dup_acks = 0;
            ch.rto_deadline = None;
            ch.probe_deadline = None;
            ch.probed = false;
            if std::mem::take(&mut ch.probe_pending) {
                self.probes_pending -= 1;
            }
            ch.inflight_bytes = 0;
            ch.owed = None;
            ch.carried = None;
            ch.last_acked = None;
        }
        self.acks.retain(|a| a.peer != peer);
        // The key's high 48 bits are the peer's MAC.
        if self.owed_unopened.is_some_and(|(k, ..)| k >> 16 == key(peer, 0) >> 16) {
            self.owed_unopened = None;
        }
    }

    /// The channel to `peer`, if this half ever sent on it (no channel is created).
    fn existing_channel(&mut self, peer: MacAddr, channel: u16) -> Option<&mut TxChannel> {
        let k = key(peer, channel);
        let i = match self.last {
            Some((lk, li)) if lk == k => li,
            _ => *self.index.get(&k)?,
        };
        self.channels.get_mut(i)
    }

    /// An ACK arrived, in an ACK frame (with the frames the receiver holds past it, `sack`) or
    /// `carried` by a DATA frame (which is never a duplicate ACK: the peer sends DATA whenever it
    /// has some, not because a frame went missing).
    #[allow(clippy::too_many_arguments)]
    fn on_ack(
        &mut self,
        now: Instant,
        peer: MacAddr,
        channel: u16,
        ack: Seq,
        echo: Option<(u32, u64)>,
        sack: &Sack,
        carried: bool,
    ) {
        let echo_ns = echo.map(|(e, _)| e);
        // How long the echoed frame waited here, after it was written, for its burst to leave.
        let left_ns = echo_ns.map_or(0, |e| self.left_after(e));
        let Some(&ci) = self.index.get(&key(peer, channel)) else {
            self.counters.bad_acks += 1;
            return;
        };
        let ch = &mut self.channels[ci];
        let advance = ack - ch.base;
        if advance < 0 {
            // An old ACK overtaken by a newer one: harmless, nothing to learn.
            return;
        }
        let advance = advance as usize;
        if advance > ch.high {
            self.counters.bad_acks += 1;
            return;
        }
        if carried && advance == 0 {
            return;
        }
        let selective = self.config.selective_repeat && !sack.is_empty();
        self.counters.acks_received += 1;
        if let Some((echo, hold_ns)) = echo {
            let rtt_ns = u64::from(stamp(now).wrapping_sub(echo));
            // An echo more than the RTO bound old is from another epoch of the 4.3 s timestamp
            // wheel (or a confused peer): no sample.
            if rtt_ns <= self.config.max_rto.as_nanos() as u64 {
                // The timer waits for the whole answer; rate control reads only the fabric's
                // share, without the time the two hosts held the frame and its ACK (scheduling,
                // ACK coalescing, the frame's wait for its burst to leave here: no queue on the
                // wire), and judges the rest against a threshold that the hosts' share widens.
                ch.rtt.on_sample(rtt_ns);
                let srtt = ch.rtt.srtt().unwrap_or(rtt_ns);
                let hold_ns = hold_ns + left_ns;
                let fabric_ns = rtt_ns.saturating_sub(hold_ns).max(1);
                self.counters.record_rtt(rtt_ns, fabric_ns);
                let host_ns = rtt_ns - fabric_ns.min(rtt_ns);
                if ch.rate.on_rtt(&self.config.rate, now, fabric_ns, host_ns, srtt) {
                    self.counters.rate_decreases += 1;
                }
            }
        }
        if advance == 0 && selective {
            if ch.high > 0 {
                self.counters.dup_acks_received += 1;
                let lost = ch.apply_sack(sack, self.config.dup_ack_threshold.max(1) as usize);
                self.counters.fast_retransmits += lost as u64;
            }
            return;
        }
        if advance == 0 {
            // A duplicate ACK is news that the frame at `base` was lost only if it answers a frame
            // sent no earlier than that frame's latest transmission (the receiver echoes the
            // timestamp of the frame it discards). Duplicates answering older frames are the
            // echoes of a go-back's own resends of frames the receiver already had; counting them
            // would start another go-back, whose resends draw the next run of duplicates (a storm
            // of resends even on a loss-free veth). The same rule lets a lost
            // retransmission be fast-retransmitted again, without waiting for the RTO.
            let base_sent = ch.frames.front().map(|f| header(f).timestamp());
            let news = match (echo_ns, base_sent) {
                (Some(echo), Some(sent)) => echo.wrapping_sub(sent) as i32 >= 0,
                _ => true,
            };
            if ch.high > 0 && news {
                ch.dup_acks += 1;
                self.counters.dup_acks_received += 1;
                if ch.dup_acks == self.config.dup_ack_threshold.max(1) {
                    ch.go_back();
                    ch.rto_deadline = None;
                    ch.probe_deadline = None;
                    self.counters.fast_retransmits += 1;
                }
            }
            return;
        }
        for i in 0..advance {
            if !ch.frames.is_empty() {
                let len = ch.frame_len(0);
                let f = ch.frames.pop_front().expect("not empty");
                ch.bodies.pop_front();
                let m = ch.marks.pop_front().unwrap_or(0);
                if m & LOST != 0 {
                    ch.lost -= 1;
                } else if i < ch.next && m & SACKED == 0 {
                    ch.inflight_bytes -= len;
                }
                self.pool.push(f);
            }
        }
        ch.base = ack;
        ch.high -= advance;
        ch.next = ch.next.saturating_sub(advance);
        ch.dup_acks = 0;
        if selective {
            let lost = ch.apply_sack(sack, self.config.dup_ack_threshold.max(1) as usize);
            self.counters.fast_retransmits += lost as u64;
        }
        ch.rtt.on_progress();
        ch.rto_deadline = (ch.high > 0).then(|| now + ch.rtt.rto());
        ch.probed = false;
        ch.probe_deadline = (ch.high > 0).then(|| probe_at(&self.config, ch, now)).flatten();
    }

    /// Says that every frame written by [`SendHalf::poll_transmit`] so far has left (the port
    /// sent its burst) at `now`. A driver that writes a burst of frames and then hands it to the
    /// port calls this after each hand-off: a frame waits there for the frames written after it,
    /// and for the kernel to send those before it, which is this host's time, not the fabric's.
    /// Rate control then leaves it out of the round trip (as it leaves out the time a receiver
    /// held a frame). Without the call a frame counts as gone when written.
    pub fn frames_left(&mut self, now: Instant) {
        self.scratch_used = 0;
        if let Some(first) = self.unflushed_since.take() {
            self.flushes[self.flush_at] = (first, stamp(now));
            self.flush_at = (self.flush_at + 1) % FLUSHES;
        }
    }

    /// How long a frame stamped `sent` waited for its burst to leave, ns (0 if its burst is not
    /// among the latest [`FLUSHES`]).
    fn left_after(&self, sent: u32) -> u64 {
        self.flushes
            .iter()
            .find(|&&(first, left)| {
                // Wrapping stamps: `first <= sent <= left`, within the 4.3 s wheel.
                sent.wrapping_sub(first) <= left.wrapping_sub(first)
            })
            .map_or(0, |&(_, left)| u64::from(left.wrapping_sub(sent)))
    }

    /// Fires due timers: retransmission timeouts (go back to the first unacknowledged frame,
    /// double the RTO) and the heartbeat schedule.
    pub fn handle_timeout(&mut self, now: Instant) {
        for ch in &mut self.channels {
            if ch.probe_deadline.is_some_and(|d| d <= now) {
                ch.probe_deadline = None;
                if ch.high > 0 && !ch.probe_pending {
                    ch.probe_pending = true;
                    ch.probed = true;
                    self.probes_pending += 1;
                    self.counters.tail_loss_probes += 1;
                }
            }
            if ch.rto_deadline.is_some_and(|d| d <= now) {
                ch.rto_deadline = None;
                if ch.high > 0 {
                    ch.go_back();
                    ch.dup_acks = 0;
                    ch.rtt.on_timeout();
                    if ch.rate.on_timeout(&self.config.rate, now) {
                        self.counters.rate_decreases += 1;
                    }
                    self.counters.timeouts += 1;
                }
            }
        }
    }

    /// The earliest time this half needs [`SendHalf::handle_timeout`] or a
    /// [`SendHalf::poll_transmit`] (a retransmission timer, a paced frame, a heartbeat).
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut t = self.next_heartbeat;
        let mut consider = |x: Instant| t = Some(t.map_or(x, |t| t.min(x)));
        for ch in &self.channels {
            if let Some(d) = ch.rto_deadline {
                consider(d);
            }
            if let Some(d) = ch.probe_deadline {
                consider(d);
            }
            if ch.has_sendable(self.window) {
                if let Some(p) = ch.rate.next_send() {
                    consider(p);
                }
            }
        }
        t
    }

    /// Writes the next frame into `buf` and returns its length, or `None` when there is nothing to
    /// send now (no ACK due, no heartbeat due, and every channel empty, window-limited or paced
    /// out: [`SendHalf::poll_timeout`] then says when to come back). ACKs go first (an advancing
    /// ACK as a DATA frame of its channel carrying it, when one may go now; duplicate ACKs always
    /// as ACK frames), then heartbeats, then DATA round-robin over channels.
    ///
    /// # Panics
    /// If `buf` is shorter than [`Config::frame_capacity`].
    #[must_use]
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        assert!(
            buf.len() >= self.config.frame_capacity(),
            "poll_transmit needs a buffer of Config::frame_capacity() = {} bytes, got {}",
            self.config.frame_capacity(),
            buf.len()
        );
        let at = self.poll_transmit_ref(now)?;
        let [head, body] = self.frame(at);
        let len = head.len() + body.len();
        buf[..head.len()].copy_from_slice(head);
        buf[head.len()..len].copy_from_slice(body);
        if let FrameAt::Scratch(_) = at.0 {
            // Copied out: the buffer is free again.
            self.scratch_used -= 1;
        }
        Some(len)
    }

    /// Whether [`SendHalf::poll_transmit_ref`] could write a frame at `now` or a little later
    /// (pacing aside): an ACK or probe is queued, a heartbeat is due or a channel has a frame its
    /// window lets go. A caller that stamps frames with a fresh clock reading reads the clock only
    /// when this says so.
    #[must_use]
    pub fn may_transmit(&self, now: Instant) -> bool {
        !self.acks.is_empty()
            || self.probes_pending > 0
            || self.next_heartbeat.is_some_and(|t| t <= now)
            || self.channels.iter().any(|c| c.has_sendable(self.window))
    }

    /// [`SendHalf::poll_transmit`] without the copy: the next frame is written where it lies (a
    /// DATA frame in the copy its channel keeps until it is acknowledged, an ACK or heartbeat in
    /// a buffer of this half's own) and [`SendHalf::frame`] gives its bytes. A reference stays
    /// valid until [`SendHalf::frames_left`] or a call of another method that takes `&mut self`
    /// other than this one: poll a burst, hand the frames to the port, then say they left.
    #[must_use]
    pub fn poll_transmit_ref(&mut self, now: Instant) -> Option<FrameRef> {
        if let Some(a) = self.acks.pop_front() {
            // An ACK that may ride on a DATA frame does so in this very call: put off to a later
            // one, its DATA frame might never go (the frames acknowledged meanwhile, pacing) and
            // the ACK, whose coalescing timer has fired already, would be lost.
            if let Some(ci) = self.carrier(now, &a) {
                return Some(self.write_data(now, ci));
            }
            return Some(self.write_scratch(|half, buf| half.write_ack(now, a, buf)));
        }
        if self.next_heartbeat.is_some_and(|t| t <= now) {
            self.next_heartbeat = Some(now + self.config.heartbeat.interval);
            return Some(self.write_scratch(|half, buf| half.write_heartbeat(now, buf)));
        }
        while self.probes_pending > 0 {
            let Some(ci) = self.channels.iter().position(|c| c.probe_pending) else {
                self.probes_pending = 0;
                break;
            };
            self.probes_pending -= 1;
            let ch = &mut self.channels[ci];
            ch.probe_pending = false;
            // An ACK may have emptied the flight since the probe was due.
            if ch.high > 0 {
                return Some(self.write_probe(now, ci));
            }
        }
        // Round robin from `rr`, wrapping by comparison: this runs on every poll, and a `%` is a
        // division each time.
        let n = self.channels.len();
        let wrap = |i: usize| if i + 1 >= n { 0 } else { i + 1 };
        let mut ci = if self.rr < n { self.rr } else { 0 };
        let mut paced = false;
        for _ in 0..n {
            let ch = &mut self.channels[ci];
            if !ch.has_sendable(self.window) {
                ci = wrap(ci);
                continue;
            }
            if !ch.rate.may_send(now) {
                paced = true;
                ci = wrap(ci);
                continue;
            }
            self.rr = wrap(ci);
            return Some(self.write_data(now, ci));
        }
        if paced {
            self.counters.paced_out += 1;
        }
        None
    }

    /// The bytes of a frame [`SendHalf::poll_transmit_ref`] wrote, in two pieces: the frame is
    /// the first followed by the second, which is empty unless the frame ends in lent bytes
    /// ([`SendHalf::send_lent`]). Both are empty for a reference made stale by a later call
    /// (see there), which a port drops as too short.
    #[must_use]
    pub fn frame(&self, at: FrameRef) -> [&[u8]; 2] {
        match at.0 {
            FrameAt::Stored { ci, index } => match self.channels.get(ci) {
                Some(c) if index < c.frames.len() => {
                    [&c.frames[index][..], c.bodies[index].as_ref().map_or(&[], LentSlice::bytes)]
                }
                _ => [&[], &[]],
            },
            FrameAt::Scratch(i) => [self.scratch.get(i).map_or(&[], |(buf, len)| &buf[..*len]), &[]],
        }
    }

    /// Writes an ACK or heartbeat frame into the next free buffer of the half's own.
    fn write_scratch(&mut self, write: impl FnOnce(&mut Self, &mut [u8]) -> usize) -> FrameRef {
        let i = self.scratch_used;
        if i == self.scratch.len() {
            self.scratch.push((vec![0; self.config.frame_capacity()].into_boxed_slice(), 0));
        }
        let mut buf = std::mem::take(&mut self.scratch[i].0);
        let len = write(self, &mut buf);
        self.scratch[i] = (buf, len);
        self.scratch_used += 1;
        FrameRef(FrameAt::Scratch(i))
    }

    /// Writes channel `ci`'s next DATA frame into `buf` (a frame found lost, else the next in
    /// order), carrying the channel's owed ACK if any. The channel must have a sendable frame
    /// that pacing allows now.
    fn write_data(&mut self, now: Instant, ci: usize) -> FrameRef {
        let index = self.channels[ci].candidate(self.window).expect("write_data needs a sendable frame");
        let len = self.emit_stored(now, ci, index);
        let ch = &mut self.channels[ci];
        if ch.marks[index] & LOST != 0 {
            ch.marks[index] &= !LOST;
            ch.lost -= 1;
            self.counters.retransmitted_frames += 1;
        } else {
            if ch.next < ch.high {
                self.counters.retransmitted_frames += 1;
            }
            ch.next += 1;
            ch.high = ch.high.max(ch.next);
            ch.skip_sacked();
        }
        ch.inflight_bytes += len;
        if ch.rto_deadline.is_none() {
            ch.rto_deadline = Some(now + ch.rtt.rto());
        }
        if ch.probe_deadline.is_none() && !ch.probed {
            ch.probe_deadline = probe_at(&self.config, ch, now);
        }
        ch.rate.on_send(now, len);
        self.counters.frames_sent += 1;
        self.counters.data_frames_sent += 1;
        FrameRef(FrameAt::Stored { ci, index })
    }

    /// Writes channel `ci`'s tail-loss probe: its oldest unacknowledged frame once more, outside
    /// the window's order (the frames after it stay in flight as they are). Whatever was lost,
    /// the receiver's answer to it moves the sender on: an ACK that advances if the frame or its
    /// ACK was lost, a duplicate ACK otherwise. A spurious probe costs one frame.
    fn write_probe(&mut self, now: Instant, ci: usize) -> FrameRef {
        self.emit_stored(now, ci, 0);
        self.counters.retransmitted_frames += 1;
        self.counters.frames_sent += 1;
        self.counters.data_frames_sent += 1;
        FrameRef(FrameAt::Stored { ci, index: 0 })
    }

    /// Readies stored frame `index` of channel `ci` for transmission now, where it lies: fresh
    /// timestamp (which `on_ack` reads back), our group and epochs, the channel's owed ACK if
    /// any (and none left from an earlier transmission), the checksum. Returns its length.
    fn emit_stored(&mut self, now: Instant, ci: usize, index: usize) -> usize {
        let now_stamp = stamp(now);
        self.unflushed_since.get_or_insert(now_stamp);
        let (group, epoch, checksum) = (self.group, self.epoch, self.config.checksum);
        let ch = &mut self.channels[ci];
        let owed = ch.owed.take();
        if let Some((ack, echo, _)) = owed {
            ch.carried = Some((ack, echo));
            ch.note_acked(ack);
            self.last_carried = Some((ch.peer, ch.channel, ack));
            self.counters.acks_carried += 1;
        }
        let peer_epoch = ch.peer_epoch;
        let frame = &mut ch.frames[index];
        let mut h = header_mut(frame);
        h.set_timestamp(now_stamp);
        h.set_group(group);
        h.set_epoch(epoch);
        h.set_peer_epoch(peer_epoch);
        let mut flags = h.flags() & !(FLAG_ACK | FLAG_ECHO | frame::FLAG_CHECKSUM);
        let (mut ack_field, mut echo_field, mut hold) = (0, 0, 0);
        if let Some((ack, echo, received)) = owed {
            ack_field = ack.0;
            flags |= FLAG_ACK;
            if let Some(echo) = echo {
                echo_field = echo;
                hold = hold_us(now, received);
                flags |= FLAG_ECHO;
            }
        }
        h.set_ack(ack_field);
        h.set_echo(echo_field);
        h.set_hold_us(hold);
        h.set_flags(flags);
        let body = ch.bodies[index].as_ref().map_or(&[][..], LentSlice::bytes);
        if checksum {
            frame::fill_checksum_parts(frame, body);
        }
        frame.len() + body.len()
    }

    /// The channel whose DATA frame can carry ACK `a` now instead of an ACK frame of its own, with
    /// `a` made its owed ACK. Never a duplicate ACK: it must be an ACK frame, the only kind the
    /// peer counts toward fast retransmit. Otherwise only an ACK that advances beyond both the
    /// last ACK sent and the owed one (no echo of an ACK already on its way), on a channel with
    /// a DATA frame that may go now.
    fn carrier(&mut self, now: Instant, a: &AckDue) -> Option<usize> {
        if a.duplicate || !a.sack.is_empty() {
            return None;
        }
        let ci = *self.index.get(&key(a.peer, a.channel))?;
        let ch = &mut self.channels[ci];
        let advances = ch.last_acked.is_some_and(|last| last.is_before(a.ack))
            && ch.owed.is_none_or(|(owed, ..)| owed.is_before(a.ack));
        if !advances || !ch.has_sendable(self.window) || !ch.rate.may_send(now) {
            return None;
        }
        ch.owed = Some((a.ack, a.echo_ns, a.received));
        Some(ci)
    }

    fn write_header(&self, buf: &mut [u8], dst: MacAddr, repr: &Repr) -> usize {
        EthernetRepr { src_addr: self.local, dst_addr: dst, ethertype: EtherType::Lanbus }
            .emit(&mut EthernetFrame::new_unchecked(&mut buf[..]));
        repr.emit(&mut Packet::new_unchecked(&mut buf[ETH_LEN..]));
        let len = ETH_LEN + LB_LEN + usize::from(repr.payload_len);
        if self.config.checksum {
            frame::fill_checksum(&mut buf[..len]);
        }
        len
    }

    fn write_ack(&mut self, now: Instant, a: AckDue, buf: &mut [u8]) -> usize {
        // An ACK frame at least as new as the owed one settles it: a DATA frame carrying the
        // owed ACK later would echo a stale timestamp.
        let settles = |owed: Seq| !a.ack.is_before(owed);
        if let Some(ch) = self.existing_channel(a.peer, a.channel) {
            if ch.owed.is_some_and(|(owed, ..)| settles(owed)) {
                ch.owed = None;
            }
            ch.note_acked(a.ack);
        } else if self.owed_unopened.is_some_and(|(k, owed, ..)| k == key(a.peer, a.channel) && settles(owed))
        {
            self.owed_unopened = None;
        }
        let sack = a.sack.as_bytes();
        buf[ETH_LEN + LB_LEN..][..sack.len()].copy_from_slice(sack);
        let mut flags = if a.echo_ns.is_some() { FLAG_ECHO } else { 0 };
        if !sack.is_empty() {
            flags |= FLAG_SACK;
        }
        let repr = Repr {
            kind: Kind::Ack,
            flags,
            group: self.group,
            channel: a.channel,
            sequence: 0,
            ack: a.ack.0,
            timestamp: stamp(now),
            echo: a.echo_ns.unwrap_or(0),
            payload_len: sack.len() as u16,
            hold_us: hold_us(now, a.received),
            epoch: self.epoch,
            peer_epoch: self.peer_epochs.get(&a.peer).copied().unwrap_or(0),
        };
        self.counters.frames_sent += 1;
        self.counters.ack_frames_sent += 1;
        self.write_header(buf, a.peer, &repr)
    }

    fn write_heartbeat(&mut self, now: Instant, buf: &mut [u8]) -> usize {
        let hb = &self.config.heartbeat;
        let payload = HeartbeatRepr {
            role: hb.role,
            group: self.group,
            interval_us: u32::try_from(hb.interval.as_micros()).unwrap_or(u32::MAX),
            name: &hb.name,
        };
        let plen = payload.emit(&mut buf[ETH_LEN + LB_LEN..]);
        let repr = Repr {
            kind: Kind::Heartbeat,
            flags: 0,
            group: self.group,
            channel: 0,
            sequence: 0,
            ack: 0,
            timestamp: stamp(now),
            echo: 0,
            payload_len: plen as u16,
            hold_us: 0,
            epoch: self.epoch,
            peer_epoch: 0,
        };
        self.counters.frames_sent += 1;
        self.counters.heartbeats_sent += 1;
        self.write_header(buf, MacAddr::BROADCAST, &repr)
    }
}

/// Resets `f` to an empty DATA frame (Ethernet + lanbus header, no records).
fn start_frame(f: &mut Vec<u8>, local: MacAddr, peer: MacAddr, channel: u16, seq: Seq) {
    f.clear();
    f.resize(ETH_LEN + LB_LEN, 0);
    EthernetRepr { src_addr: local, dst_addr: peer, ethertype: EtherType::Lanbus }
        .emit(&mut EthernetFrame::new_unchecked(&mut f[..]));
    Repr {
        kind: Kind::Data,
        flags: 0,
        group: 0,
        channel,
        sequence: seq.0,
        ack: 0,
        timestamp: 0,
        echo: 0,
        hold_us: 0,
        epoch: 0,
        peer_epoch: 0,
        payload_len: 0,
    }
    .emit(&mut Packet::new_unchecked(&mut f[ETH_LEN..]));
}

/// A message's bytes as [`SendHalf::send_from`] takes them: how many, and any range of them
/// appended to a frame. A sender whose bytes live elsewhere (memory behind locks, a header and a
/// payload apart) copies them once, straight into the frames.
pub trait MessageSource {
    /// The message's length.
    fn len(&self) -> usize;
    /// Whether the message is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Appends the message's bytes `at..at + n` (inside the message) to `f`.
    fn append_to(&mut self, f: &mut Vec<u8>, at: usize, n: usize);
}

/// Memory a sender lends the transport until it lets go (see [`SendHalf::send_lent`]): read
/// only, from whichever thread transmits, for as long as a reference to it is held.
pub trait Lend: Send + Sync + 'static {
    /// The bytes lent.
    fn bytes(&self) -> &[u8];
}

impl Lend for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// A range of lent memory, holding a reference to it.
#[derive(Clone)]
pub struct LentSlice {
    owner: Arc<dyn Lend>,
    start: usize,
    end: usize,
}

impl LentSlice {
    /// The bytes `range` of `owner`'s. Panics if `range` is not inside them.
    pub fn new(owner: Arc<dyn Lend>, range: std::ops::Range<usize>) -> LentSlice {
        assert!(
            range.start <= range.end && range.end <= owner.bytes().len(),
            "lent range {range:?} outside {} bytes",
            owner.bytes().len()
        );
        LentSlice { owner, start: range.start, end: range.end }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.owner.bytes()[self.start..self.end]
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// The part `range` of this slice (relative to it), sharing the reference. Panics if
    /// `range` is not inside it.
    pub fn slice(&self, range: std::ops::Range<usize>) -> LentSlice {
        assert!(range.start <= range.end && range.end <= self.len());
        LentSlice {
            owner: Arc::clone(&self.owner),
            start: self.start + range.start,
            end: self.start + range.end,
        }
    }
}

/// A message of `head`, `gap` zero bytes, `body` and `tail` zero bytes, read as one run of bytes
/// without building it (a memory write TLP's header, the bytes before the first one it enables,
/// its data and the rest of its last DW, say).
pub struct Gathered<'a> {
    /// The first bytes.
    pub head: &'a [u8],
    /// Zero bytes after `head`.
    pub gap: usize,
    /// The bytes after those.
    pub body: &'a [u8],
    /// Zero bytes at the end.
    pub tail: usize,
}

impl MessageSource for Gathered<'_> {
    fn len(&self) -> usize {
        self.head.len() + self.gap + self.body.len() + self.tail
    }

    fn append_to(&mut self, f: &mut Vec<u8>, at: usize, n: usize) {
        let end = at + n;
        let h = self.head.len();
        let (body_start, body_end) = (h + self.gap, h + self.gap + self.body.len());
        let mut pos = at;
        if pos < h.min(end) {
            f.extend_from_slice(&self.head[pos..h.min(end)]);
            pos = h.min(end);
        }
        if pos < body_start.min(end) {
            f.resize(f.len() + body_start.min(end) - pos, 0);
            pos = body_start.min(end);
        }
        if pos < body_end.min(end) {
            f.extend_from_slice(&self.body[pos - body_start..body_end.min(end) - body_start]);
            pos = body_end.min(end);
        }
        f.resize(f.len() + (end - pos), 0);
    }
}

/// A message in pieces, read as one run of bytes.
struct Parts<'a>(&'a [&'a [u8]]);

impl MessageSource for Parts<'_> {
    fn len(&self) -> usize {
        self.0.iter().map(|p| p.len()).sum()
    }

    fn append_to(&mut self, f: &mut Vec<u8>, mut at: usize, mut n: usize) {
        for p in self.0 {
            if n == 0 {
                return;
            }
            if at >= p.len() {
                at -= p.len();
                continue;
            }
            let take = (p.len() - at).min(n);
            f.extend_from_slice(&p[at..at + take]);
            at = 0;
            n -= take;
        }
    }
}

/// Appends the header of a record of `n` bytes (lanbus_wire::frame::MessageRecord's), written in
/// place: this runs once per message, and extend_from_slice avoids zero-filling bytes about to be
/// overwritten.
fn push_record_header(f: &mut Vec<u8>, flags: u8, n: usize) {
    let [n0, n1] = (n as u16).to_be_bytes();
    f.extend_from_slice(&[n0, n1, flags, 0]);
}

/// Appends a record of the message's bytes `at..at + n` to a frame and updates its payload
/// length.
fn append_record(f: &mut Vec<u8>, flags: u8, data: &mut dyn MessageSource, at: usize, n: usize) {
    push_record_header(f, flags, n);
    data.append_to(f, at, n);
    let plen = (f.len() - ETH_LEN - LB_LEN) as u16;
    header_mut(f).set_payload_len(plen);
}
