//! Incast through one switch port: N senders, one receiver, an output-queued port with a
//! drop-tail buffer (a small model of the simulator's multi-session figure, to check that rate
//! control does what it is for).

use core::time::Duration;
use std::collections::BinaryHeap;

use lanbus_wire::{Instant, MacAddr};

use crate::testutil::test_message;
use crate::{Config, Counters, Endpoint, SendError};

struct Ev {
    at: Instant,
    id: u64,
    to: usize,
    at_switch: bool,
    bytes: Vec<u8>,
}
impl PartialEq for Ev {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.id) == (o.at, o.id)
    }
}
impl Eq for Ev {}
impl PartialOrd for Ev {
    fn partial_cmp(&self, o: &Self) -> Option<core::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Ev {
    fn cmp(&self, o: &Self) -> core::cmp::Ordering {
        (o.at, o.id).cmp(&(self.at, self.id))
    }
}

pub(crate) struct StarResult {
    pub completion: Duration,
    pub drops: u64,
    pub senders: Counters,
    pub max_queue: Duration,
}

fn ser(bytes: usize, rate_bps: u64) -> Duration {
    Duration::from_nanos((bytes as u64 + 24) * 8_000_000_000 / rate_bps)
}

/// `senders` hosts each send `bytes_each` (as 64 KiB messages) to host 0 at t = 0.
pub(crate) fn incast(config: &Config, senders: usize, bytes_each: usize, buffer_bytes: u64) -> StarResult {
    let rate = 10_000_000_000u64;
    let delay = Duration::from_micros(1);
    let mut nodes: Vec<Endpoint> = (0..=senders)
        .map(|i| Endpoint::new(config.clone(), MacAddr::local(i as u32 + 1), Instant::ZERO))
        .collect();
    let mut nic_free = vec![Instant::ZERO; senders + 1];
    let mut port_free = vec![Instant::ZERO; senders + 1];
    let mut heap = BinaryHeap::new();
    let mut id = 0u64;
    let mut now = Instant::ZERO;
    let mut buf = vec![0u8; config.frame_capacity()];
    let mut queued = vec![0usize; senders + 1];
    let msgs_each = bytes_each.div_ceil(65_536);
    let (mut drops, mut delivered, mut max_queue) = (0u64, 0usize, Duration::ZERO);
    let total = msgs_each * senders;
    let mut steps = 0u64;
    while delivered < total || nodes.iter().any(|n| !n.is_idle()) {
        steps += 1;
        assert!(steps < 20_000_000, "incast did not finish");
        let mut did = false;
        for (i, n) in nodes.iter_mut().enumerate() {
            if i > 0 {
                while queued[i] < msgs_each {
                    match n.send(now, MacAddr::local(1), 0, &test_message(queued[i] as u64, 65_536)) {
                        Ok(()) => queued[i] += 1,
                        Err(SendError::QueueFull) => break,
                        Err(e) => panic!("{e}"),
                    }
                }
            }
            if n.poll_timeout().is_some_and(|t| t <= now) {
                n.handle_timeout(now);
                did = true;
            }
            while let Some(len) = n.poll_transmit(now, &mut buf) {
                let dst = usize::from(buf[5]) - 1;
                let depart = nic_free[i].max(now) + ser(len, rate);
                nic_free[i] = depart;
                id += 1;
                heap.push(Ev {
                    at: depart + delay,
                    id,
                    to: dst,
                    at_switch: true,
                    bytes: buf[..len].to_vec(),
                });
                did = true;
            }
        }
        while heap.peek().is_some_and(|e| e.at <= now) {
            let e = heap.pop().expect("peeked");
            did = true;
            if e.at_switch {
                let start = port_free[e.to].max(now);
                let backlog = (start - now).as_nanos() as u64 * rate / 8_000_000_000;
                if backlog + e.bytes.len() as u64 > buffer_bytes {
                    drops += 1;
                    continue;
                }
                max_queue = max_queue.max(start - now);
                port_free[e.to] = start + ser(e.bytes.len(), rate);
                id += 1;
                heap.push(Ev { at: port_free[e.to] + delay, id, to: e.to, at_switch: false, bytes: e.bytes });
            } else {
                nodes[e.to].handle_frame(now, &e.bytes);
                while nodes[e.to].poll_message().is_some() {
                    delivered += 1;
                }
            }
        }
        if !did {
            let next = heap
                .peek()
                .map(|e| e.at)
                .into_iter()
                .chain(nodes.iter().filter_map(|n| n.poll_timeout()))
                .min();
            now = next.expect("something pending").max(now + Duration::from_nanos(1));
        }
    }
    let mut senders_c = Counters::default();
    for n in &nodes[1..] {
        senders_c.merge(&n.counters());
    }
    StarResult { completion: now - Instant::ZERO, drops, senders: senders_c, max_queue }
}

#[test]
fn rate_control_helps_an_incast() {
    for senders in [4usize, 8] {
        let mut c = Config::point_to_point();
        // The star's links run at 10 Gbit/s.
        c.rate.line_rate_bps = 10_000_000_000;
        c.rate.enabled = false;
        let off = incast(&c, senders, 512 * 1024, 128 * 1024);
        c.rate.enabled = true;
        let on = incast(&c, senders, 512 * 1024, 128 * 1024);
        // Payload at 10 Gbit/s; frames add about 5 % (headers, preamble, gap).
        let ideal = Duration::from_nanos((senders * 512 * 1024) as u64 * 8 / 10);
        let summary = format!(
            "{senders} senders, ideal {ideal:?}: without rate control {:?}, {} drops, {} resent, \
             {} timeouts; with {:?}, {} drops, {} resent, {} timeouts, queue up to {:?}",
            off.completion,
            off.drops,
            off.senders.retransmitted_frames,
            off.senders.timeouts,
            on.completion,
            on.drops,
            on.senders.retransmitted_frames,
            on.senders.timeouts,
            on.max_queue
        );
        // An order of magnitude fewer drops (16-23x here: 36 against 821 with 4 senders, 246
        // against 4049 with 8).
        assert!(on.drops * 10 < off.drops, "{summary}");
        // With 8 senders the losses cost far more than pacing; with 4 the two come close (the
        // 25 µs target, above the scheduling noise of a busy host, lets the first bursts queue
        // longer before the cut), and rate control may cost a few percent at most.
        let slack = if senders >= 8 { 1.0 } else { 1.08 };
        assert!(on.completion.as_secs_f64() < off.completion.as_secs_f64() * slack, "{summary}");
        assert!(on.completion.as_secs_f64() < ideal.as_secs_f64() * 1.3, "{summary}");
    }
}
