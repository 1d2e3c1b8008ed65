//! Transport layer: what the transport counts. Invariant: counters only grow.

use core::time::Duration;

/// Counts of everything an endpoint (or one half of it) did. Read with `counters()`; the halves'
/// counters add up to the endpoint's ([`Counters::merge`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Frames written by `poll_transmit` (all kinds).
    pub frames_sent: u64,
    /// DATA frames among them (first transmissions and retransmissions).
    pub data_frames_sent: u64,
    /// ACK frames among them.
    pub ack_frames_sent: u64,
    /// HEARTBEAT frames among them.
    pub heartbeats_sent: u64,
    /// ACKs carried on DATA frames (piggybacked) instead of sent as ACK frames.
    pub acks_carried: u64,
    /// DATA frames sent again (go-back resends, selective resends and probes).
    pub retransmitted_frames: u64,
    /// Fast retransmits: go-backs on duplicate ACKs, or with selective repeat, frames found
    /// lost (a frame sent no earlier than them was selectively acknowledged).
    pub fast_retransmits: u64,
    /// Retransmission timeouts (go-backs on the timer).
    pub timeouts: u64,
    /// Tail-loss probes: the oldest unacknowledged frame sent again after about two round trips
    /// without an ACK, before the retransmission timer (see [`Config::tail_loss_probe`]).
    ///
    /// [`Config::tail_loss_probe`]: crate::Config::tail_loss_probe
    pub tail_loss_probes: u64,
    /// Frames in flight sent again because a path that may have carried them failed (see
    /// [`SendHalf::resend_in_flight`](crate::SendHalf::resend_in_flight)).
    pub path_resends: u64,
    /// Times `poll_transmit` had data but was held back by pacing.
    pub paced_out: u64,
    /// Frames handed to `handle_frame`.
    pub frames_received: u64,
    /// ACKs received (duplicates included).
    pub acks_received: u64,
    /// Duplicate ACKs received (ACKs that did not advance while data was outstanding).
    pub dup_acks_received: u64,
    /// ACKs that acknowledged data never sent, or from a channel we never sent on.
    pub bad_acks: u64,
    /// Duplicate ACKs sent: one per out-of-order or already-received DATA frame, each in an ACK
    /// frame of its own (never carried on DATA), so they are also among `ack_frames_sent`.
    pub dup_acks_sent: u64,
    /// Frames dropped: too short, not lanbus, bad lengths, malformed records or heartbeat.
    pub drop_bad_frame: u64,
    /// Frames dropped: unknown lanbus version.
    pub drop_bad_version: u64,
    /// Frames dropped: unknown kind.
    pub drop_unknown_kind: u64,
    /// Frames dropped: checksum missing or wrong.
    pub drop_bad_checksum: u64,
    /// Frames dropped: addressed to another MAC, or sent by ourselves.
    pub drop_not_for_us: u64,
    /// DATA/ACK frames dropped: the sender's group is not ours.
    pub drop_wrong_group: u64,
    /// DATA/ACK frames dropped: heartbeats are on and the sender was never heard (or is down).
    pub drop_unknown_peer: u64,
    /// DATA frames dropped: ahead of the next expected sequence (with selective repeat: too far
    /// ahead to hold, or no room).
    pub drop_out_of_order: u64,
    /// DATA frames held past a hole until it fills (selective repeat); not a drop.
    pub frames_held: u64,
    /// DATA frames dropped: already received.
    pub drop_duplicate: u64,
    /// Frames dropped: sent by an earlier incarnation of the peer, or meant for an earlier
    /// incarnation of this endpoint (their epochs say so).
    pub drop_stale_epoch: u64,
    /// Peers seen coming back with a new epoch (restarted): their channels started afresh.
    pub peer_restarts: u64,
    /// DATA frames dropped: the application has not drained enough delivered messages.
    pub drop_backlog: u64,
    /// DATA frames dropped: they would open more than `max_channels` receive channels (or
    /// heartbeats: more than `max_channels` peers).
    pub drop_too_many_channels: u64,
    /// Messages accepted by `send`.
    pub messages_sent: u64,
    /// Bytes in them.
    pub bytes_sent: u64,
    /// Bytes among them that stayed in their sender's memory, lent to the frames (see
    /// [`SendHalf::send_lent`]); the rest were copied into the frames.
    ///
    /// [`SendHalf::send_lent`]: crate::SendHalf::send_lent
    pub bytes_lent: u64,
    /// Messages received in order and made available to `poll_message`.
    pub messages_delivered: u64,
    /// Bytes in them.
    pub bytes_delivered: u64,
    /// Bytes the receiving side copied to deliver them: messages that could not be lent from
    /// their frame, a message in several frames once more as it is put together, and frames
    /// held past a hole (selective repeat) once more.
    pub bytes_copied_on_delivery: u64,
    /// RTT samples taken.
    pub rtt_samples: u64,
    /// Smallest RTT sample, ns (0 before the first).
    pub rtt_min_ns: u64,
    /// Largest RTT sample, ns.
    pub rtt_max_ns: u64,
    /// Sum of RTT samples, ns (see [`Counters::rtt_mean`]).
    pub rtt_sum_ns: u64,
    /// Sum of the fabric's share of the RTT samples, ns: each sample less the time the two hosts
    /// held the frame and its ACK (see [`Counters::fabric_rtt_mean`]). Rate control reads this.
    pub fabric_rtt_sum_ns: u64,
    /// Rate cuts by rate control (on delay above target, and on timeouts).
    pub rate_decreases: u64,
}

impl Counters {
    /// Mean RTT, if any sample was taken.
    pub fn rtt_mean(&self) -> Option<Duration> {
        self.rtt_sum_ns.checked_div(self.rtt_samples).map(Duration::from_nanos)
    }

    /// Mean of the fabric's share of the RTT, if any sample was taken.
    pub fn fabric_rtt_mean(&self) -> Option<Duration> {
        self.fabric_rtt_sum_ns.checked_div(self.rtt_samples).map(Duration::from_nanos)
    }

    /// Smallest RTT, if any sample was taken.
    pub fn rtt_min(&self) -> Option<Duration> {
        (self.rtt_samples > 0).then(|| Duration::from_nanos(self.rtt_min_ns))
    }

    /// Largest RTT, if any sample was taken.
    pub fn rtt_max(&self) -> Option<Duration> {
        (self.rtt_samples > 0).then(|| Duration::from_nanos(self.rtt_max_ns))
    }

    /// Frames dropped for any reason.
    pub fn drops(&self) -> u64 {
        self.drop_bad_frame
            + self.drop_bad_version
            + self.drop_unknown_kind
            + self.drop_bad_checksum
            + self.drop_not_for_us
            + self.drop_wrong_group
            + self.drop_unknown_peer
            + self.drop_out_of_order
            + self.drop_duplicate
            + self.drop_stale_epoch
            + self.drop_backlog
            + self.drop_too_many_channels
    }

    pub(crate) fn record_rtt(&mut self, ns: u64, fabric_ns: u64) {
        self.fabric_rtt_sum_ns = self.fabric_rtt_sum_ns.saturating_add(fabric_ns);
        if self.rtt_samples == 0 || ns < self.rtt_min_ns {
            self.rtt_min_ns = ns;
        }
        self.rtt_max_ns = self.rtt_max_ns.max(ns);
        self.rtt_sum_ns = self.rtt_sum_ns.saturating_add(ns);
        self.rtt_samples += 1;
    }

    /// Adds `other` into `self` (RTT min/max combine as min/max).
    pub fn merge(&mut self, other: &Counters) {
        let (min_a, na) = (self.rtt_min_ns, self.rtt_samples);
        macro_rules! add {
            ($($f:ident),*) => { $( self.$f += other.$f; )* };
        }
        add!(
            frames_sent,
            data_frames_sent,
            ack_frames_sent,
            heartbeats_sent,
            acks_carried,
            retransmitted_frames,
            fast_retransmits,
            timeouts,
            tail_loss_probes,
            path_resends,
            paced_out,
            frames_received,
            acks_received,
            dup_acks_received,
            bad_acks,
            dup_acks_sent,
            drop_bad_frame,
            drop_bad_version,
            drop_unknown_kind,
            drop_bad_checksum,
            drop_not_for_us,
            drop_wrong_group,
            drop_unknown_peer,
            drop_out_of_order,
            frames_held,
            drop_duplicate,
            drop_stale_epoch,
            peer_restarts,
            drop_backlog,
            drop_too_many_channels,
            messages_sent,
            bytes_sent,
            bytes_lent,
            messages_delivered,
            bytes_delivered,
            bytes_copied_on_delivery,
            rtt_samples,
            rate_decreases
        );
        self.fabric_rtt_sum_ns = self.fabric_rtt_sum_ns.saturating_add(other.fabric_rtt_sum_ns);
        self.rtt_sum_ns = self.rtt_sum_ns.saturating_add(other.rtt_sum_ns);
        self.rtt_max_ns = self.rtt_max_ns.max(other.rtt_max_ns);
        self.rtt_min_ns = match (na, other.rtt_samples) {
            (0, _) => other.rtt_min_ns,
            (_, 0) => min_a,
            _ => min_a.min(other.rtt_min_ns),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rtt_statistics_merge() {
        let mut a = Counters::default();
        assert_eq!(a.rtt_mean(), None);
        a.record_rtt(10, 4);
        a.record_rtt(30, 20);
        let mut b = Counters::default();
        b.record_rtt(5, 3);
        b.frames_sent = 2;
        let mut m = Counters::default();
        m.merge(&a);
        m.merge(&b);
        assert_eq!((m.rtt_min_ns, m.rtt_max_ns, m.rtt_samples, m.frames_sent), (5, 30, 3, 2));
        assert_eq!(m.rtt_mean(), Some(Duration::from_nanos(15)));
        assert_eq!(m.fabric_rtt_mean(), Some(Duration::from_nanos(9)));
    }
}
