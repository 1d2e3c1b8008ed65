//! The receiving half (transport layer): frame validation, the group rule, in-order acceptance
//! (with selective repeat, frames past a hole are held until it fills), reassembly, delivery
//! without per-message allocation, ACK generation and the peer table.
//!
//! Every byte here comes from the network and is distrusted: lengths are checked by the wire
//! views, record flags must form whole messages, reassembled messages are bounded by 64 KiB, the
//! channel table by `max_channels` and the undelivered bytes by `max_receive_backlog_bytes`. A
//! frame is accepted whole or not at all (validated before any state changes).
//!
//! Delivery: accepted payloads are copied once into an arena; `poll_message` lends slices of it.
//! Invariant: messages sit in the arena in delivery order, so everything before the end of the
//! last message taken is free. The arena is reset when everything was taken and compacted when its
//! free prefix is large, so a steady stream reuses one buffer.

use std::collections::{HashMap, VecDeque};

use lanbus_wire::ethernet::{EtherType, EthernetFrame, HEADER_LEN as ETH_LEN};
use lanbus_wire::frame::{
    self, HeartbeatRepr, Kind, Packet, Records, Role, Sack, FLAG_ACK, FLAG_CHECKSUM, FLAG_ECHO, FLAG_SACK,
    HEADER_LEN as LB_LEN, MAX_MESSAGE_LEN, RECORD_FIRST, RECORD_HEADER_LEN, RECORD_LAST, SACK_MAX_FRAMES,
};
use lanbus_wire::{Instant, MacAddr};

use crate::map::{key, ChannelMap};
use crate::{Config, Counters, Event, Feedback, Seq};

/// A delivered message, lent by [`ReceiveHalf::poll_message`] until the next call that changes
/// the endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message<'a> {
    /// The peer that sent it.
    pub peer: MacAddr,
    /// Its channel.
    pub channel: u16,
    /// Its bytes.
    pub data: &'a [u8],
}

struct RxChannel {
    peer: MacAddr,
    channel: u16,
    expected: Seq,
    /// Fragments of a message being reassembled (reused between messages).
    partial: Vec<u8>,
    in_partial: bool,
    unacked: u32,
    ack_deadline: Option<Instant>,
    last_timestamp: u32,
    /// When the frame of `last_timestamp` arrived.
    last_arrival: Instant,
    /// Selective repeat: frames that arrived past a hole, `held[k]` being sequence `expected + k`
    /// (so `held[0]` is always `None`: the hole). Empty when nothing is held.
    held: VecDeque<Option<Held>>,
}

/// A DATA frame received past a hole, kept until the frames before it arrive.
struct Held {
    payload: Vec<u8>,
}

impl RxChannel {
    /// The frames held past the hole at `expected`, as an ACK reports them.
    fn sack(&self) -> Sack {
        let mut s = Sack::EMPTY;
        for (k, h) in self.held.iter().enumerate().skip(1) {
            if h.is_some() {
                s.set(k - 1);
            }
        }
        s
    }
}

/// The parts of a DATA frame that [`ReceiveHalf::handle_data`] works on.
struct DataFrame<'a> {
    src: MacAddr,
    channel: u16,
    seq: Seq,
    ts: u32,
    payload: &'a [u8],
}

#[derive(Debug, Clone, Copy)]
struct Delivered {
    peer: MacAddr,
    channel: u16,
    start: usize,
    len: usize,
}

/// What this half knows of a peer's incarnations.
struct Incarnations {
    current: u32,
    /// Its earlier epochs, most recent first: frames still carrying one are stale.
    retired: [u32; 4],
}

struct Peer {
    role: Role,
    group: u16,
    name: String,
    /// How long the peer stays up after any valid frame from it: its announced heartbeat
    /// interval times the missed-heartbeat limit.
    lifetime: core::time::Duration,
    expires: Instant,
}

/// The receiving half of an [`Endpoint`](crate::Endpoint): owns everything that reads frames.
///
/// Call order: [`ReceiveHalf::handle_frame`] for each frame, [`ReceiveHalf::handle_timeout`] when
/// [`ReceiveHalf::poll_timeout`] is due, then drain [`ReceiveHalf::poll_feedback`] (into the
/// [`SendHalf`](crate::SendHalf)), [`ReceiveHalf::poll_message`] and [`ReceiveHalf::poll_event`].
/// Time never goes back.
pub struct ReceiveHalf {
    config: Config,
    local: MacAddr,
    group: u16,
    channels: Vec<RxChannel>,
    index: ChannelMap,
    last: Option<(u64, usize)>,
    armed_acks: usize,
    peers: HashMap<MacAddr, Peer>,
    /// The peer whose expiry was last pushed back by a frame, and when: a burst from one peer
    /// looks its entry up once per a sixteenth of its lifetime, not once per frame.
    refreshed: Option<(MacAddr, Instant)>,
    /// This incarnation's epoch.
    epoch: u32,
    /// Every peer's epochs, and the last (peer, epoch) found current (a burst from one peer looks
    /// its entry up once).
    incarnations: HashMap<MacAddr, Incarnations>,
    epoch_seen: Option<(MacAddr, u32)>,
    arena: Vec<u8>,
    consumed: usize,
    delivered: VecDeque<Delivered>,
    /// Messages of the frame just taken that are to be lent from it: (peer, channel) and byte
    /// ranges of the frame (see [`ReceiveHalf::take_frame_to_lend`]).
    lend_from: (MacAddr, u16),
    lend: Vec<core::ops::Range<usize>>,
    feedback: VecDeque<Feedback>,
    events: VecDeque<Event>,
    /// When the frame being taken reached this host (its port's receive timestamp, else `now`):
    /// the ACKs it causes report how long it was held from then, and an ACK it carries how long
    /// it waited here before it was read.
    arrived: Instant,
    /// Payload bytes held past holes on every channel (they count toward the receive backlog).
    held_bytes: usize,
    /// Buffers of held frames, for reuse.
    held_pool: Vec<Vec<u8>>,
    counters: Counters,
}

impl ReceiveHalf {
    pub(crate) fn new(config: Config, local: MacAddr) -> Self {
        let epoch = config.epoch.max(1);
        ReceiveHalf {
            group: config.group,
            config,
            local,
            channels: Vec::new(),
            index: ChannelMap::default(),
            last: None,
            armed_acks: 0,
            peers: HashMap::new(),
            refreshed: None,
            epoch,
            incarnations: HashMap::new(),
            epoch_seen: None,
            arena: Vec::new(),
            consumed: 0,
            delivered: VecDeque::new(),
            lend_from: (MacAddr([0; 6]), 0),
            lend: Vec::new(),
            feedback: VecDeque::new(),
            events: VecDeque::new(),
            arrived: Instant::ZERO,
            held_bytes: 0,
            held_pool: Vec::new(),
            counters: Counters::default(),
        }
    }

    /// What this half counted (frames received, drops by reason, messages delivered...).
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Changes the group DATA/ACK frames must carry to be accepted.
    pub fn set_group(&mut self, group: u16) {
        self.group = group;
    }

    /// Peers currently alive (heard within their expiry): MAC, role, group, name.
    pub fn peers(&self) -> impl Iterator<Item = (MacAddr, Role, u16, &str)> {
        self.peers.iter().map(|(m, p)| (*m, p.role, p.group, p.name.as_str()))
    }

    /// The next delivered message, in arrival order (in order per channel). The slice stays valid
    /// until the next `&mut` call.
    #[must_use]
    pub fn poll_message(&mut self) -> Option<Message<'_>> {
        let d = self.delivered.pop_front()?;
        self.consumed = d.start + d.len;
        Some(Message { peer: d.peer, channel: d.channel, data: &self.arena[d.start..d.start + d.len] })
    }

    /// The next peer event.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// The next value for the [`SendHalf`](crate::SendHalf) (ACKs received, ACKs to send).
    #[must_use]
    pub fn poll_feedback(&mut self) -> Option<Feedback> {
        self.feedback.pop_front()
    }

    /// The earliest ACK-coalescing deadline or peer expiry.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut t: Option<Instant> = None;
        let mut consider = |x: Instant| t = Some(t.map_or(x, |t| t.min(x)));
        if self.armed_acks > 0 {
            for ch in &self.channels {
                if let Some(d) = ch.ack_deadline {
                    consider(d);
                }
            }
        }
        for p in self.peers.values() {
            consider(p.expires);
        }
        t
    }

    /// The sending half carried ACK `ack` to `peer` on `channel` on a DATA frame: when it
    /// covers every frame accepted there (and none is held past a hole, which only an ACK
    /// frame's SACK reports), no ACK frame is owed for them any more: the count toward
    /// [`Config::ack_every_frames`] and the ACK delay start again with the next frame. Without
    /// this, a ping-pong (whose every answer carries the ACK of the question) sent an ACK frame
    /// of its own for every few messages, a second system call and a second frame to handle at
    /// the peer. Only a whole endpoint can tell: split halves keep the plain rule.
    pub fn ack_carried(&mut self, peer: MacAddr, channel: u16, ack: Seq) {
        let Some(ci) = self.existing_channel_index(peer, channel) else { return };
        let ch = &mut self.channels[ci];
        if ack != ch.expected || !ch.held.is_empty() {
            return;
        }
        ch.unacked = 0;
        if ch.ack_deadline.take().is_some() {
            self.armed_acks -= 1;
        }
    }

    /// Sends due coalesced ACKs and expires silent peers.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.armed_acks > 0 {
            for ch in &mut self.channels {
                if ch.ack_deadline.is_some_and(|d| d <= now) {
                    ch.ack_deadline = None;
                    ch.unacked = 0;
                    self.armed_acks -= 1;
                    self.feedback.push_back(Feedback::SendAck {
                        peer: ch.peer,
                        channel: ch.channel,
                        ack: ch.expected,
                        echo_ns: Some(ch.last_timestamp),
                        received: ch.last_arrival,
                        sack: ch.sack(),
                    });
                }
            }
        }
        let mut down = Vec::new();
        for (mac, p) in &self.peers {
            if p.expires <= now {
                down.push(*mac);
            }
        }
        down.sort();
        for mac in down {
            self.peers.remove(&mac);
            self.events.push_back(Event::PeerDown { peer: mac });
        }
    }

    /// Takes one received Ethernet frame (padding after the lanbus payload is allowed). Never
    /// panics; whatever is wrong is counted and dropped.
    pub fn handle_frame(&mut self, now: Instant, frame: &[u8]) {
        self.take_frame(now, now, frame, false);
    }

    /// Takes one received frame like [`ReceiveHalf::handle_frame`], which reached this host at
    /// `arrived` (the port's receive timestamp; taken as `now` if later): the time since is this
    /// host's, not the fabric's. The ACKs the frame causes report their hold from `arrived`, and
    /// an ACK it carries adds the wait to the peer's reported hold, so that rate control reads
    /// neither end's scheduling delay as queueing.
    pub fn handle_frame_at(&mut self, now: Instant, arrived: Instant, frame: &[u8]) {
        self.take_frame(now, arrived, frame, false);
    }

    /// Takes one received frame like [`ReceiveHalf::handle_frame`], but notes the messages it
    /// completes for [`ReceiveHalf::lend`] to lend straight from the frame, without copying them,
    /// when that keeps them in order: nothing delivered earlier still waits in
    /// [`ReceiveHalf::poll_message`], and the frame holds whole messages only (fragments are
    /// reassembled and queued as usual, and so is every message while older ones wait). The
    /// frame's feedback is queued as usual. Only `lend` of the same frame may follow
    /// (crate-private: misuse would lose messages already acknowledged); see
    /// [`Endpoint::handle_frame_delivering`](crate::Endpoint::handle_frame_delivering).
    pub(crate) fn take_frame_to_lend(&mut self, now: Instant, arrived: Instant, frame: &[u8]) {
        self.take_frame(now, arrived, frame, true);
    }

    /// Lends the messages noted by the last [`ReceiveHalf::take_frame_to_lend`] from `frame`,
    /// which must be the same frame.
    pub(crate) fn lend(&mut self, frame: &[u8], deliver: &mut dyn FnMut(Message<'_>)) {
        let (peer, channel) = self.lend_from;
        for r in self.lend.drain(..) {
            deliver(Message { peer, channel, data: &frame[r] });
        }
    }

    fn take_frame(&mut self, now: Instant, arrived: Instant, frame: &[u8], lend: bool) {
        self.lend.clear();
        self.arrived = arrived.min(now);
        // How long the frame waited here before this call, added to an ACK's reported hold.
        let waited_ns = now.saturating_duration_since(self.arrived).as_nanos() as u64;
        self.counters.frames_received += 1;
        self.reclaim();
        let Ok(eth) = EthernetFrame::new_checked(frame) else {
            self.counters.drop_bad_frame += 1;
            return;
        };
        if eth.ethertype() != EtherType::Lanbus {
            self.counters.drop_bad_frame += 1;
            return;
        }
        let src = eth.src_addr();
        let dst = eth.dst_addr();
        if src == self.local || src.is_multicast() {
            self.counters.drop_not_for_us += 1;
            return;
        }
        let Ok(packet) = Packet::new_checked(eth.payload()) else {
            self.counters.drop_bad_frame += 1;
            return;
        };
        if packet.version() != frame::VERSION {
            self.counters.drop_bad_version += 1;
            return;
        }
        let whole = &frame[..ETH_LEN + LB_LEN + usize::from(packet.payload_len())];
        let has_sum = packet.flags() & FLAG_CHECKSUM != 0;
        if (self.config.checksum && !has_sum) || (has_sum && !frame::verify_checksum(whole)) {
            self.counters.drop_bad_checksum += 1;
            return;
        }
        if (dst == self.local || dst.is_broadcast()) && !self.check_epoch(src, packet.epoch()) {
            return;
        }
        // Any valid frame is a sign of life: a peer busy sending data stays up without heartbeats.
        self.refresh(now, src);
        let kind = packet.kind();
        if kind == Kind::Heartbeat {
            if dst != self.local && !dst.is_broadcast() {
                self.counters.drop_not_for_us += 1;
            } else {
                self.handle_heartbeat(now, src, packet.payload());
            }
            return;
        }
        if let Kind::Unknown(_) | Kind::Handshake | Kind::Path = kind {
            self.counters.drop_unknown_kind += 1;
            return;
        }
        if dst != self.local {
            self.counters.drop_not_for_us += 1;
            return;
        }
        if packet.group() != self.group {
            self.counters.drop_wrong_group += 1;
            return;
        }
        if self.config.heartbeat.enabled && !self.peers.contains_key(&src) {
            self.counters.drop_unknown_peer += 1;
            return;
        }
        let channel = packet.channel();
        let meant_for = packet.peer_epoch();
        if meant_for != 0 && meant_for != self.epoch {
            // Sent to an earlier incarnation of ours: the peer has not heard of our restart. An
            // ACK frame of ours (it carries our epoch) tells it at once.
            self.counters.drop_stale_epoch += 1;
            let ack = self
                .channel_index(src, channel)
                .map_or(Seq(self.config.initial_sequence), |i| self.channels[i].expected);
            self.feedback.push_back(Feedback::SendDuplicateAck {
                peer: src,
                channel,
                ack,
                echo_ns: None,
                received: self.arrived,
                sack: Sack::EMPTY,
            });
            return;
        }
        if kind == Kind::Data && packet.flags() & FLAG_ACK != 0 {
            // A cumulative ACK is true whatever becomes of the frame's own data below.
            let echo_ns = (packet.flags() & FLAG_ECHO != 0).then(|| packet.echo());
            self.feedback.push_back(Feedback::AckCarried {
                peer: src,
                channel,
                ack: Seq(packet.ack()),
                echo_ns,
                hold_ns: u64::from(packet.hold_us()) * 1000 + waited_ns,
            });
        }
        if kind == Kind::Ack {
            let echo_ns = (packet.flags() & FLAG_ECHO != 0).then(|| packet.echo());
            let sack =
                if packet.flags() & FLAG_SACK != 0 { Sack::parse(packet.payload()) } else { Sack::EMPTY };
            self.feedback.push_back(Feedback::AckReceived {
                peer: src,
                channel,
                ack: Seq(packet.ack()),
                echo_ns,
                hold_ns: u64::from(packet.hold_us()) * 1000 + waited_ns,
                sack,
            });
            return;
        }
        let payload = packet.payload();
        self.handle_data(
            now,
            DataFrame { src, channel, seq: Seq(packet.sequence()), ts: packet.timestamp(), payload },
            lend,
        );
    }

    /// Checks a frame's sender epoch: false if the frame comes from an earlier incarnation of the
    /// peer (drop it). A new epoch means the peer restarted: its channels start afresh here, and
    /// the sending half and the application are told.
    fn check_epoch(&mut self, peer: MacAddr, epoch: u32) -> bool {
        if self.epoch_seen == Some((peer, epoch)) {
            return true;
        }
        if epoch == 0 {
            // Every sender stamps a nonzero epoch.
            self.counters.drop_bad_frame += 1;
            return false;
        }
        let full = self.incarnations.len() >= self.config.max_channels;
        match self.incarnations.get_mut(&peer) {
            // Bounded like the channels: a flood of made-up MACs does not grow the table.
            None if full => {}
            None => {
                self.incarnations.insert(peer, Incarnations { current: epoch, retired: [0; 4] });
                self.feedback.push_back(Feedback::PeerEpoch { peer, epoch });
            }
            Some(inc) if inc.current == epoch => {}
            Some(inc) if inc.retired.contains(&epoch) => {
                self.counters.drop_stale_epoch += 1;
                return false;
            }
            Some(inc) => {
                inc.retired.rotate_right(1);
                inc.retired[0] = inc.current;
                inc.current = epoch;
                self.restart_channels(peer);
                self.counters.peer_restarts += 1;
                self.feedback.push_back(Feedback::PeerRestarted { peer, epoch });
                self.events.push_back(Event::PeerRestarted { peer, epoch });
            }
        }
        self.epoch_seen = Some((peer, epoch));
        true
    }

    /// Starts every receive channel from `peer` afresh (it restarted). Messages already
    /// delivered stay for `poll_message`; a message half reassembled is dropped.
    fn restart_channels(&mut self, peer: MacAddr) {
        for ci in 0..self.channels.len() {
            if self.channels[ci].peer == peer {
                self.drop_held(ci);
            }
        }
        for ch in self.channels.iter_mut().filter(|c| c.peer == peer) {
            ch.expected = Seq(self.config.initial_sequence);
            ch.partial.clear();
            ch.in_partial = false;
            ch.unacked = 0;
            if ch.ack_deadline.take().is_some() {
                self.armed_acks -= 1;
            }
            ch.last_timestamp = 0;
            ch.last_arrival = Instant::ZERO;
        }
        self.feedback.retain(|f| !matches!(f, Feedback::AckOwed { peer: p, .. } | Feedback::SendAck { peer: p, .. } if *p == peer));
    }

    /// Pushes back the expiry of `peer`, if it is in the peer table.
    fn refresh(&mut self, now: Instant, peer: MacAddr) {
        if let Some((last, at)) = self.refreshed {
            if last == peer && now.saturating_duration_since(at) < self.config.heartbeat.interval / 16 {
                return;
            }
        }
        if let Some(p) = self.peers.get_mut(&peer) {
            p.expires = p.expires.max(now + p.lifetime);
            self.refreshed = Some((peer, now));
        }
    }

    /// Drops the delivered prefix of the arena once the application has taken it.
    fn reclaim(&mut self) {
        if self.delivered.is_empty() {
            self.arena.clear();
            self.consumed = 0;
        } else if self.consumed > 0 && self.consumed >= self.arena.len() / 2 {
            let c = self.consumed;
            self.arena.copy_within(c.., 0);
            self.arena.truncate(self.arena.len() - c);
            for d in &mut self.delivered {
                debug_assert!(d.start >= c, "undelivered message before the consumed prefix");
                d.start -= c;
            }
            self.consumed = 0;
        }
    }

    /// The channel's index if it is open (never opens one).
    fn existing_channel_index(&self, peer: MacAddr, channel: u16) -> Option<usize> {
        let k = key(peer, channel);
        match self.last {
            Some((lk, li)) if lk == k => Some(li),
            _ => self.index.get(&k).copied(),
        }
    }

    fn channel_index(&mut self, peer: MacAddr, channel: u16) -> Option<usize> {
        let k = key(peer, channel);
        if let Some((lk, li)) = self.last {
            if lk == k {
                return Some(li);
            }
        }
        let i = match self.index.get(&k) {
            Some(&i) => i,
            None => {
                if self.channels.len() >= self.config.max_channels {
                    return None;
                }
                let i = self.channels.len();
                self.channels.push(RxChannel {
                    peer,
                    channel,
                    expected: Seq(self.config.initial_sequence),
                    partial: Vec::new(),
                    in_partial: false,
                    unacked: 0,
                    ack_deadline: None,
                    last_timestamp: 0,
                    last_arrival: Instant::ZERO,
                    held: VecDeque::new(),
                });
                self.index.insert(k, i);
                i
            }
        };
        self.last = Some((k, i));
        Some(i)
    }

    fn handle_data(&mut self, now: Instant, f: DataFrame<'_>, lend: bool) {
        let DataFrame { src, channel, seq, ts, payload } = f;
        let Some(ci) = self.channel_index(src, channel) else {
            self.counters.drop_too_many_channels += 1;
            return;
        };
        let expected = self.channels[ci].expected;
        if seq != expected {
            if expected.is_before(seq) {
                self.hold(ci, seq - expected, payload);
            } else {
                self.counters.drop_duplicate += 1;
            }
            // Answer at once: a duplicate ACK tells the sender what is missing (and, with
            // selective repeat, what is held past it). It goes in an ACK frame of its own (only
            // those count toward fast retransmit), one per frame.
            let ch = &mut self.channels[ci];
            if ch.ack_deadline.take().is_some() {
                self.armed_acks -= 1;
            }
            ch.unacked = 0;
            self.counters.dup_acks_sent += 1;
            self.feedback.push_back(Feedback::SendDuplicateAck {
                peer: src,
                channel,
                ack: ch.expected,
                echo_ns: Some(ts),
                received: self.arrived,
                sack: ch.sack(),
            });
            return;
        }
        if self.backlog() + payload.len() > self.config.max_receive_backlog_bytes {
            self.counters.drop_backlog += 1;
            return;
        }
        if !self.deliver(ci, payload, lend) {
            return;
        }
        if self.channels[ci].held.is_empty() {
            self.accepted(now, ci, ts);
        } else {
            self.fill_hole(ci, ts);
        }
    }

    /// Bytes received and not yet taken by the application, or held past a hole.
    fn backlog(&self) -> usize {
        self.arena.len() - self.consumed + self.held_bytes
    }

    /// Selective repeat: keeps DATA frame `expected + ahead` of channel `ci`, which arrived before
    /// the frames ahead of it, if its records parse and there is room (the frames' bytes count
    /// toward the receive backlog, and at most [`SACK_MAX_FRAMES`] frames past the hole are
    /// kept, as many as an ACK can report). Otherwise it is dropped and counted.
    fn hold(&mut self, ci: usize, ahead: i32, payload: &[u8]) {
        let ahead = ahead as usize;
        let room = self.backlog() + payload.len() <= self.config.max_receive_backlog_bytes;
        if !self.config.selective_repeat || ahead > SACK_MAX_FRAMES || !room {
            self.counters.drop_out_of_order += 1;
            return;
        }
        if self.channels[ci].held.get(ahead).is_some_and(Option::is_some) {
            self.counters.drop_duplicate += 1;
            return;
        }
        // The records' own shape is checked now; whether they continue the message before
        // them, when the hole fills.
        if Records::new(payload).any(|r| r.is_err()) {
            self.counters.drop_bad_frame += 1;
            return;
        }
        let mut buf = self.held_pool.pop().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(payload);
        self.counters.bytes_copied_on_delivery += buf.len() as u64;
        self.held_bytes += buf.len();
        let held = &mut self.channels[ci].held;
        if held.len() <= ahead {
            held.resize_with(ahead + 1, || None);
        }
        held[ahead] = Some(Held { payload: buf });
        self.counters.frames_held += 1;
    }

    /// The frame at `expected` of channel `ci` (sent at `ts`) was just delivered and frames past
    /// it are held: delivers those that now follow in order, and acknowledges at once (the
    /// sender waits for this ACK to learn the hole is filled), with what is still held.
    fn fill_hole(&mut self, ci: usize, ts: u32) {
        let arrived = self.arrived;
        let ch = &mut self.channels[ci];
        ch.expected = ch.expected + 1;
        ch.held.pop_front();
        while let Some(Some(_)) = self.channels[ci].held.front() {
            let Some(Some(h)) = self.channels[ci].held.pop_front() else { unreachable!() };
            self.held_bytes -= h.payload.len();
            let ok = self.deliver(ci, &h.payload, false);
            self.held_pool.push(h.payload);
            if !ok {
                // Whole records that do not continue the message before them: the peer is
                // broken. Everything held is let go; the sender's timer sends it again.
                self.drop_held(ci);
                break;
            }
            self.channels[ci].expected = self.channels[ci].expected + 1;
        }
        let ch = &mut self.channels[ci];
        if ch.held.iter().all(Option::is_none) {
            ch.held.clear();
        }
        ch.last_timestamp = ts;
        ch.last_arrival = arrived;
        ch.unacked = 0;
        if ch.ack_deadline.take().is_some() {
            self.armed_acks -= 1;
        }
        self.feedback.push_back(Feedback::SendAck {
            peer: ch.peer,
            channel: ch.channel,
            ack: ch.expected,
            echo_ns: Some(ts),
            received: arrived,
            sack: ch.sack(),
        });
    }

    /// Lets go of every frame held past a hole on channel `ci`.
    fn drop_held(&mut self, ci: usize) {
        for h in self.channels[ci].held.drain(..).flatten() {
            self.held_bytes -= h.payload.len();
            self.held_pool.push(h.payload);
        }
    }

    /// Validates the payload of the frame at `expected` on channel `ci` against the message being
    /// reassembled there, then delivers its messages (noted for lending if `lend` and order
    /// allows, else copied into the arena). False, with nothing changed, if the records do not
    /// form whole messages with what came before.
    fn deliver(&mut self, ci: usize, payload: &[u8], lend: bool) -> bool {
        let ch = &mut self.channels[ci];
        let (src, channel) = (ch.peer, ch.channel);
        // Validate the whole frame before changing anything.
        let mut in_partial = ch.in_partial;
        let mut partial_len = ch.partial.len();
        let mut all_whole = true;
        for rec in Records::new(payload) {
            let Ok(rec) = rec else {
                self.counters.drop_bad_frame += 1;
                return false;
            };
            let first = rec.flags & RECORD_FIRST != 0;
            if first == in_partial {
                // A FIRST inside a message, or a continuation outside one.
                self.counters.drop_bad_frame += 1;
                return false;
            }
            partial_len = if first { 0 } else { partial_len } + rec.data.len();
            if partial_len > MAX_MESSAGE_LEN {
                self.counters.drop_bad_frame += 1;
                return false;
            }
            in_partial = rec.flags & RECORD_LAST == 0;
            all_whole &= rec.flags == RECORD_FIRST | RECORD_LAST;
        }
        // Accept. Whole messages with nothing queued before them are lent from the frame: note
        // where they are (the payload follows the two headers).
        if lend && all_whole && self.delivered.is_empty() {
            let mut off = 0;
            while off < payload.len() {
                let n = usize::from(u16::from_be_bytes([payload[off], payload[off + 1]]));
                let start = ETH_LEN + LB_LEN + off + RECORD_HEADER_LEN;
                self.lend.push(start..start + n);
                off += RECORD_HEADER_LEN + n;
                self.counters.messages_delivered += 1;
                self.counters.bytes_delivered += n as u64;
            }
            self.lend_from = (src, channel);
            return true;
        }
        // Arena positions grow in delivery order (so `consumed` bounds what was taken): a frame
        // of whole messages is copied in one piece, others record by record.
        let bulk_base = self.arena.len();
        if all_whole {
            self.arena.extend_from_slice(payload);
            self.counters.bytes_copied_on_delivery += payload.len() as u64;
        }
        let mut off = 0;
        while off < payload.len() {
            let n = usize::from(u16::from_be_bytes([payload[off], payload[off + 1]]));
            let flags = payload[off + 2];
            let start = off + RECORD_HEADER_LEN;
            let data = start..start + n;
            off = data.end;
            let complete = match (flags & RECORD_FIRST != 0, flags & RECORD_LAST != 0) {
                (true, true) if all_whole => Some((bulk_base + data.start, n)),
                (true, true) => {
                    let at = self.arena.len();
                    self.arena.extend_from_slice(&payload[data]);
                    self.counters.bytes_copied_on_delivery += n as u64;
                    Some((at, n))
                }
                (true, false) => {
                    ch.partial.clear();
                    ch.partial.extend_from_slice(&payload[data]);
                    self.counters.bytes_copied_on_delivery += n as u64;
                    ch.in_partial = true;
                    None
                }
                (false, last) => {
                    ch.partial.extend_from_slice(&payload[data]);
                    self.counters.bytes_copied_on_delivery += n as u64;
                    last.then(|| {
                        ch.in_partial = false;
                        let at = self.arena.len();
                        self.arena.extend_from_slice(&ch.partial);
                        self.counters.bytes_copied_on_delivery += ch.partial.len() as u64;
                        (at, ch.partial.len())
                    })
                }
            };
            if let Some((start, len)) = complete {
                self.delivered.push_back(Delivered { peer: src, channel, start, len });
                self.counters.messages_delivered += 1;
                self.counters.bytes_delivered += len as u64;
            }
        }
        true
    }

    /// Moves channel `ci` past the frame just accepted (sent at `ts`) and owes or sends its ACK.
    fn accepted(&mut self, now: Instant, ci: usize, ts: u32) {
        let received = self.arrived;
        let ch = &mut self.channels[ci];
        let (peer, channel) = (ch.peer, ch.channel);
        ch.expected = ch.expected + 1;
        ch.unacked += 1;
        ch.last_timestamp = ts;
        ch.last_arrival = received;
        if ch.unacked >= self.config.ack_every_frames.max(1) || self.config.ack_delay.is_zero() {
            ch.unacked = 0;
            if ch.ack_deadline.take().is_some() {
                self.armed_acks -= 1;
            }
            self.feedback.push_back(Feedback::SendAck {
                peer,
                channel,
                ack: ch.expected,
                echo_ns: Some(ts),
                received,
                sack: Sack::EMPTY,
            });
        } else {
            if ch.ack_deadline.is_none() {
                ch.ack_deadline = Some(now + self.config.ack_delay);
                self.armed_acks += 1;
            }
            // The sending half may carry this ACK on a DATA frame before the deadline.
            self.feedback.push_back(Feedback::AckOwed {
                peer,
                channel,
                ack: ch.expected,
                echo_ns: Some(ts),
                received,
            });
        }
    }

    fn handle_heartbeat(&mut self, now: Instant, src: MacAddr, payload: &[u8]) {
        let Ok(hb) = HeartbeatRepr::parse(payload) else {
            self.counters.drop_bad_frame += 1;
            return;
        };
        if !self.config.heartbeat.enabled {
            return;
        }
        // Distrust the announced interval: between 1 ms and 60 s.
        let interval = core::time::Duration::from_micros(u64::from(hb.interval_us).clamp(1_000, 60_000_000));
        let lifetime = interval * self.config.heartbeat.missed_limit.max(1);
        let expires = now + lifetime;
        match self.peers.get_mut(&src) {
            Some(p) => {
                p.lifetime = lifetime;
                p.expires = p.expires.max(expires);
                p.role = hb.role;
                if p.name != hb.name {
                    p.name = hb.name.to_string();
                }
                if p.group != hb.group {
                    self.events.push_back(Event::GroupChanged { peer: src, old: p.group, new: hb.group });
                    p.group = hb.group;
                }
            }
            None => {
                let name = hb.name.to_string();
                self.peers.insert(src, Peer { role: hb.role, group: hb.group, name, lifetime, expires });
                self.events.push_back(Event::PeerUp {
                    peer: src,
                    role: hb.role,
                    group: hb.group,
                    name: hb.name.to_string(),
                });
            }
        }
    }
}
