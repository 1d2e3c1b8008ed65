//! 100,000 messages over a lossy simulated wire: two engines on one node send to an engine on
//! the other through real lanbus transport endpoints (the transport's deterministic two-node
//! harness: logical clock, seeded loss, reordering and duplication of frames). Sizes are mixed
//! (most eager, some rendezvous of up to 160 KiB), tags are 0..8 in two contexts, and the
//! receiver posts receives of every kind: exact, any source, any tag, any of both, some before
//! the messages arrive, some after, some probed and claimed first. It checks MPI's ordering
//! rule: the messages of one sender in one context and tag are matched in the order sent, each
//! exactly once, and arrive intact. (Matched, not completed: a rendezvous receive completes once
//! its data is in, after eager receives matched later.)

use std::collections::HashMap;

use lanbus_msg::{wire, Addr, Config, Engine, Match, Outcome, Outgoing, RequestId, Source, MSG_CHANNEL};
use lanbus_transport::testutil::{Faults, Pair, Rng};
use lanbus_transport::{Config as TransportConfig, Endpoint, SendError};
use lanbus_wire::{Instant, MacAddr};

const MESSAGES: u64 = 100_000;
const SENDERS: u16 = 2;
const TAGS: u64 = 8;
/// Sends each sender keeps under way.
const SEND_WINDOW: usize = 64;
/// Receives the receiver keeps posted.
const POSTED: usize = 24;
const MAX_LEN: usize = 160 << 10;

/// Message `seq` of (`sender`, `context`, `tag`): a 16-byte header naming it, then bytes derived
/// from it.
fn message(sender: u16, context: u32, tag: u64, seq: u32, len: usize) -> Vec<u8> {
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&sender.to_le_bytes());
    m.extend_from_slice(&(context as u16).to_le_bytes());
    m.extend_from_slice(&(tag as u32).to_le_bytes());
    m.extend_from_slice(&seq.to_le_bytes());
    m.extend_from_slice(&(len as u32).to_le_bytes());
    let mut x = u64::from(seq) << 16 ^ u64::from(sender) << 8 ^ tag ^ u64::from(context) << 40;
    while m.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        m.push(x as u8);
    }
    m.truncate(len);
    m
}

fn length(rng: &mut Rng) -> usize {
    match rng.below(1000) {
        0..=2 => 16 * 1024 + 1 + rng.below((MAX_LEN - 16 * 1024) as u64) as usize,
        3..=60 => 257 + rng.below(16 * 1024 - 256) as usize,
        _ => 16 + rng.below(241) as usize,
    }
}

struct Sender {
    engine: Engine,
    sent: u64,
    quota: u64,
    open: usize,
    seq: HashMap<(u32, u64), u32>,
}

/// Hands what `engine` has to `node`'s transport; a record the transport cannot take yet waits
/// in `held`.
fn transmit(engine: &mut Engine, held: &mut Option<Outgoing>, node: &mut Endpoint, now: Instant) {
    loop {
        let Some(o) = held.take().or_else(|| engine.poll_transmit()) else { return };
        match node.send(now, o.dest, MSG_CHANNEL, &o.bytes) {
            Ok(()) => {}
            Err(SendError::QueueFull) => {
                *held = Some(o);
                return;
            }
            Err(e) => panic!("transport refused a record: {e}"),
        }
    }
}

#[test]
fn a_hundred_thousand_messages_keep_mpi_order_over_a_lossy_wire() {
    let faults = Faults { loss: 0.01, reorder: 0.01, duplicate: 0.002, ..Faults::default() };
    let mut pair = Pair::endpoints(TransportConfig::point_to_point(), faults, 7);
    let (mac_a, mac_b) = (MacAddr::local(1), MacAddr::local(2));
    let receiver_addr = Addr { mac: mac_b, id: 1 };
    let cfg = Config::default();
    let mut senders: Vec<Sender> = (0..SENDERS)
        .map(|i| Sender {
            engine: Engine::new(Addr { mac: mac_a, id: i + 1 }, cfg.clone()),
            sent: 0,
            quota: MESSAGES / u64::from(SENDERS),
            open: 0,
            seq: HashMap::new(),
        })
        .collect();
    let mut receiver = Engine::new(receiver_addr, cfg);
    let mut held_a: Vec<Option<Outgoing>> = vec![None; SENDERS as usize];
    let mut held_b: Option<Outgoing> = None;
    let mut rng = Rng::new(11);
    // Per (sender, context, tag): (match order, sequence number) of every message received.
    let mut streams: HashMap<(u16, u32, u64), Vec<(u64, u32)>> = HashMap::new();
    let mut posted: Vec<RequestId> = Vec::new();
    let mut received = 0u64;
    let mut kinds = [0u64; 5];
    let mut idle_rounds = 0;
    let deadline = Instant::ZERO + core::time::Duration::from_secs(600);

    while received < MESSAGES {
        assert!(pair.now < deadline, "stalled at {received} messages received");
        let now = pair.now;
        // Senders: keep their windows full.
        for s in senders.iter_mut() {
            while s.open < SEND_WINDOW && s.sent < s.quota {
                let context = rng.below(2) as u32;
                let tag = rng.below(TAGS);
                let seq = s.seq.entry((context, tag)).or_insert(0);
                let id = s.engine.addr().id;
                let data = message(id, context, tag, *seq, length(&mut rng));
                *seq += 1;
                s.engine.send(receiver_addr, context, tag, data);
                s.sent += 1;
                s.open += 1;
            }
        }
        // The receiver: keep receives of every kind posted; sometimes probe and claim instead.
        while posted.len() < POSTED && received + (posted.len() as u64) < MESSAGES {
            let sender = Source::Only(Addr { mac: mac_a, id: 1 + rng.below(u64::from(SENDERS)) as u16 });
            let context = rng.below(2) as u32;
            let tag = rng.below(TAGS);
            let kind = rng.below(100) as usize;
            // After a quiet spell only receives that take anything: the messages still to come
            // may all be of kinds the exact receives do not take.
            let kind = if idle_rounds > 50 { 99 } else { kind };
            let m = match kind {
                0..=39 => Match::exact(sender, context, tag),
                40..=69 => Match::exact(Source::Any, context, tag),
                70..=89 => Match::any_tag(sender, context),
                _ => Match::any_tag(Source::Any, context),
            };
            let k = [39, 69, 89, 100].iter().position(|&b| kind <= b).unwrap();
            kinds[k] += 1;
            if rng.below(20) == 0 {
                if let Some((claim, status)) = receiver.claim(m) {
                    kinds[4] += 1;
                    assert!(status.len as usize <= MAX_LEN);
                    posted.push(receiver.recv_claimed(claim, MAX_LEN).expect("this engine's claim"));
                    continue;
                }
            }
            posted.push(receiver.post_recv(m, MAX_LEN));
        }
        if idle_rounds > 50 {
            // Swap exact receives that may never match for ones that take anything.
            for id in posted.clone() {
                if receiver.cancel(id) {
                    posted.retain(|&p| p != id);
                }
            }
            idle_rounds = 0;
        }
        for (s, held) in senders.iter_mut().zip(held_a.iter_mut()) {
            transmit(&mut s.engine, held, &mut pair.a, now);
        }
        transmit(&mut receiver, &mut held_b, &mut pair.b, now);
        pair.step();
        let mut progress = false;
        for (mac, channel, bytes) in pair.at_b.drain(..) {
            assert_eq!((mac, channel), (mac_a, MSG_CHANNEL));
            assert_eq!(wire::destination(&bytes), Some(1));
            receiver.handle_message(mac, &bytes);
        }
        for (mac, channel, bytes) in pair.at_a.drain(..) {
            assert_eq!((mac, channel), (mac_b, MSG_CHANNEL));
            let to = wire::destination(&bytes).expect("a record") as usize - 1;
            senders[to].engine.handle_message(mac, &bytes);
        }
        for s in senders.iter_mut() {
            while let Some(c) = s.engine.poll_completion() {
                assert_eq!(c.outcome, Outcome::Sent);
                s.open -= 1;
            }
        }
        while let Some(c) = receiver.poll_completion() {
            progress = true;
            if c.outcome == Outcome::Cancelled {
                continue;
            }
            posted.retain(|&p| p != c.id);
            let Outcome::Received { status, data, truncated, matched } = c.outcome else {
                panic!("receive {:?} ended {:?}", c.id, c.outcome)
            };
            assert!(!truncated);
            let sender = u16::from_le_bytes([data[0], data[1]]);
            let context = u32::from(u16::from_le_bytes([data[2], data[3]]));
            let tag = u64::from(u32::from_le_bytes(data[4..8].try_into().unwrap()));
            let seq = u32::from_le_bytes(data[8..12].try_into().unwrap());
            assert_eq!(
                (status.source.id, status.context, status.tag, status.len),
                (sender, context, tag, data.len() as u64)
            );
            streams.entry((sender, context, tag)).or_default().push((matched, seq));
            assert!(
                data == message(sender, context, tag, seq, data.len()),
                "message {seq} of {sender} damaged"
            );
            received += 1;
        }
        idle_rounds = if progress { 0 } else { idle_rounds + 1 };
    }
    let mut total = 0;
    for ((sender, context, tag), mut got) in streams {
        got.sort();
        for (i, &(_, seq)) in got.iter().enumerate() {
            let near = &got[i.saturating_sub(3)..(i + 3).min(got.len())];
            assert_eq!(
                seq, i as u32,
                "sender {sender}, context {context}, tag {tag}: (match, message) {near:?}"
            );
        }
        total += got.len() as u64;
    }
    assert_eq!(total, MESSAGES);
    let c = receiver.counters();
    assert_eq!((c.bad_records, c.misrouted, c.stray, c.truncated), (0, 0, 0, 0));
    assert!(c.unexpected > 1000, "many messages waited for their receive: {c:?}");
    let rendezvous: u64 = senders.iter().map(|s| s.engine.counters().rendezvous_sent).sum();
    assert!(rendezvous > 100, "{rendezvous} rendezvous sends");
    assert!(kinds.iter().all(|&k| k > 100), "every kind of receive was used: {kinds:?}");
    assert!(pair.wire.lost > 100, "the wire lost frames: {:?}", pair.wire);
}
