//! Transport layer: the single-threaded endpoint, a [`SendHalf`] and a [`ReceiveHalf`] wired
//! directly together (every [`Feedback`](crate::Feedback) value is handed over at once, in order).

use lanbus_wire::{Instant, MacAddr};

use crate::{Config, Counters, Event, FrameRef, Message, ReceiveHalf, SendError, SendHalf};

/// One transport endpoint: all channels of one MAC address. See the crate docs for the call order.
///
/// ```
/// use lanbus_transport::{Config, Endpoint};
/// use lanbus_wire::{Instant, MacAddr};
///
/// let (ma, mb) = (MacAddr::local(1), MacAddr::local(2));
/// let now = Instant::ZERO;
/// let mut a = Endpoint::new(Config::point_to_point(), ma, now);
/// let mut b = Endpoint::new(Config::point_to_point(), mb, now);
/// a.send(now, mb, 7, b"hello").unwrap();
/// let mut buf = vec![0u8; a.config().frame_capacity()];
/// while let Some(n) = a.poll_transmit(now, &mut buf) {
///     b.handle_frame(now, &buf[..n]);
/// }
/// let m = b.poll_message().unwrap();
/// assert_eq!((m.peer, m.channel, m.data), (ma, 7, &b"hello"[..]));
/// ```
pub struct Endpoint {
    tx: SendHalf,
    rx: ReceiveHalf,
    config: Config,
    local: MacAddr,
}

impl Endpoint {
    /// An endpoint for `local_mac` with `config`, starting at `now`.
    pub fn new(config: Config, local_mac: MacAddr, now: Instant) -> Self {
        Endpoint {
            tx: SendHalf::new(config.clone(), local_mac, now),
            rx: ReceiveHalf::new(config.clone(), local_mac),
            config,
            local: local_mac,
        }
    }

    /// The settings it was made with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Its MAC address.
    pub fn local_mac(&self) -> MacAddr {
        self.local
    }

    /// Splits into halves for a sender thread and a receiver thread. The driver must move every
    /// [`ReceiveHalf::poll_feedback`] value into [`SendHalf::handle_feedback`].
    pub fn split(self) -> (SendHalf, ReceiveHalf) {
        (self.tx, self.rx)
    }

    /// Queues a message (up to 64 KiB) for `peer` on `channel`; see [`SendHalf::send`].
    pub fn send(&mut self, now: Instant, peer: MacAddr, channel: u16, data: &[u8]) -> Result<(), SendError> {
        self.tx.send(now, peer, channel, data)
    }

    /// Queues a message made of `parts`; see [`SendHalf::send_parts`].
    pub fn send_parts(
        &mut self,
        now: Instant,
        peer: MacAddr,
        channel: u16,
        parts: &[&[u8]],
    ) -> Result<(), SendError> {
        self.tx.send_parts(now, peer, channel, parts)
    }

    /// Queues a message whose body stays in lent memory; see [`SendHalf::send_lent`].
    pub fn send_lent(
        &mut self,
        now: Instant,
        peer: MacAddr,
        channel: u16,
        head: &[u8],
        body: crate::LentSlice,
    ) -> Result<(), SendError> {
        self.tx.send_lent(now, peer, channel, head, body)
    }

    /// Sends `peer` every frame in flight again; see [`SendHalf::resend_in_flight`].
    pub fn resend_in_flight(&mut self, peer: MacAddr) {
        self.tx.resend_in_flight(peer);
    }

    /// Gives up on `peer`; see [`SendHalf::abandon_peer`].
    pub fn abandon_peer(&mut self, peer: MacAddr) {
        self.tx.abandon_peer(peer);
    }

    /// Queues a message whose bytes `data` appends itself; see [`SendHalf::send_from`].
    pub fn send_from(
        &mut self,
        now: Instant,
        peer: MacAddr,
        channel: u16,
        data: &mut dyn crate::MessageSource,
    ) -> Result<(), SendError> {
        self.tx.send_from(now, peer, channel, data)
    }

    fn route(&mut self, now: Instant) {
        while let Some(f) = self.rx.poll_feedback() {
            self.tx.handle_feedback(now, f);
        }
    }

    /// Takes one received Ethernet frame.
    pub fn handle_frame(&mut self, now: Instant, frame: &[u8]) {
        self.rx.handle_frame(now, frame);
        self.route(now);
    }

    /// Takes one received Ethernet frame that reached this host at `arrived` (the port's receive
    /// timestamp); see [`ReceiveHalf::handle_frame_at`].
    pub fn handle_frame_at(&mut self, now: Instant, arrived: Instant, frame: &[u8]) {
        self.rx.handle_frame_at(now, arrived, frame);
        self.route(now);
    }

    /// Takes one received Ethernet frame and lends the messages it completes to `deliver`, with
    /// the sending half for replies, straight from `frame` where order allows (nothing older
    /// waits in [`Endpoint::poll_message`], and the frame holds whole messages only); the rest
    /// wait in `poll_message` as after [`Endpoint::handle_frame`]. The frame's ACKs reach the sending half first, as
    /// they do before `poll_message`, so a reply finds the queue room they free. Saves copying
    /// every received byte once.
    pub fn handle_frame_delivering(
        &mut self,
        now: Instant,
        frame: &[u8],
        deliver: &mut dyn FnMut(Message<'_>, &mut SendHalf),
    ) {
        self.handle_frame_delivering_at(now, now, frame, deliver);
    }

    /// [`Endpoint::handle_frame_delivering`] for a frame that reached this host at `arrived`
    /// (the port's receive timestamp); see [`ReceiveHalf::handle_frame_at`].
    pub fn handle_frame_delivering_at(
        &mut self,
        now: Instant,
        arrived: Instant,
        frame: &[u8],
        deliver: &mut dyn FnMut(Message<'_>, &mut SendHalf),
    ) {
        self.rx.take_frame_to_lend(now, arrived, frame);
        self.route(now);
        let tx = &mut self.tx;
        self.rx.lend(frame, &mut |m| deliver(m, tx));
    }

    /// Fires due timers (ACK coalescing, peer expiry, retransmission, heartbeats).
    pub fn handle_timeout(&mut self, now: Instant) {
        self.rx.handle_timeout(now);
        self.route(now);
        self.tx.handle_timeout(now);
    }

    /// Writes the next frame to send into `buf` (at least [`Config::frame_capacity`] bytes);
    /// `None` when nothing may be sent now. See [`SendHalf::poll_transmit`].
    #[must_use]
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        let n = self.tx.poll_transmit(now, buf);
        if let Some((peer, channel, ack)) = self.tx.take_carried() {
            self.rx.ack_carried(peer, channel, ack);
        }
        n
    }

    /// See [`SendHalf::messages_queued`].
    #[must_use]
    pub fn messages_queued(&self) -> u64 {
        self.tx.messages_queued()
    }

    /// See [`SendHalf::may_transmit`].
    #[must_use]
    pub fn may_transmit(&self, now: Instant) -> bool {
        self.tx.may_transmit(now)
    }

    /// [`Endpoint::poll_transmit`] without the copy; see [`SendHalf::poll_transmit_ref`].
    #[must_use]
    pub fn poll_transmit_ref(&mut self, now: Instant) -> Option<FrameRef> {
        let at = self.tx.poll_transmit_ref(now);
        if let Some((peer, channel, ack)) = self.tx.take_carried() {
            self.rx.ack_carried(peer, channel, ack);
        }
        at
    }

    /// The bytes of a frame [`Endpoint::poll_transmit_ref`] wrote; see [`SendHalf::frame`].
    #[must_use]
    pub fn frame(&self, at: FrameRef) -> [&[u8]; 2] {
        self.tx.frame(at)
    }

    /// Says that every frame written so far has left at `now`; see [`SendHalf::frames_left`].
    pub fn frames_left(&mut self, now: Instant) {
        self.tx.frames_left(now);
    }

    /// When to call [`Endpoint::handle_timeout`] / [`Endpoint::poll_transmit`] next.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        match (self.tx.poll_timeout(), self.rx.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The next delivered message; see [`ReceiveHalf::poll_message`].
    #[must_use]
    pub fn poll_message(&mut self) -> Option<Message<'_>> {
        self.rx.poll_message()
    }

    /// The next delivered message together with the sending half, so that a reply can be queued
    /// ([`SendHalf::send`]) while the message is still borrowed, without copying either.
    #[must_use]
    pub fn poll_message_with_sender(&mut self) -> Option<(Message<'_>, &mut SendHalf)> {
        let m = self.rx.poll_message()?;
        Some((m, &mut self.tx))
    }

    /// The next peer event.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<Event> {
        self.rx.poll_event()
    }

    /// Both halves' counters, added.
    pub fn counters(&self) -> Counters {
        let mut c = self.tx.counters();
        c.merge(&self.rx.counters());
        c
    }

    /// Changes the local group at run time: frames are stamped with it, only DATA/ACK frames of
    /// this group are accepted, and a heartbeat announces it at the next `poll_transmit`.
    pub fn set_group(&mut self, group: u16, now: Instant) {
        self.tx.set_group(group, now);
        self.rx.set_group(group);
    }

    /// Whether every message sent has been acknowledged and no ACK waits to be sent.
    pub fn is_idle(&self) -> bool {
        self.tx.is_idle()
    }

    /// The sending half, for inspection (queue lengths, pacing rate).
    pub fn send_half(&self) -> &SendHalf {
        &self.tx
    }

    /// The sending half, to queue messages while a received message or event is being handled
    /// (see [`Endpoint::poll_message_with_sender`]).
    pub fn send_half_mut(&mut self) -> &mut SendHalf {
        &mut self.tx
    }

    /// The receiving half, for inspection (peer table).
    pub fn receive_half(&self) -> &ReceiveHalf {
        &self.rx
    }
}
