//! An in-process learning switch: N ports in real time, for tests with several hosts and devices.
//!
//! Layer: ports. Every frame a port transmits goes to the port that last sent from its
//! destination MAC (learned from source addresses), or to every other port when the destination
//! is unknown, broadcast or multicast, as an Ethernet switch does. Optional faults: seeded random
//! loss, a fixed delay, and links that can be cut (a cut port's frames vanish both ways, as if its
//! cable were pulled).
//!
//! Invariants: frames of one sender to one receiver arrive in order; loss decisions come from one
//! ChaCha RNG seeded by [`HubConfig::seed`], drawn once per delivered copy under the hub's lock
//! (so the sequence of decisions is fixed; which frame gets which decision depends on how the
//! threads interleave).

use core::time::Duration;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use lanbus_wire::MacAddr;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{Port, PortCounters, PortError, Result};

/// How the hub behaves.
#[derive(Debug, Clone, PartialEq)]
pub struct HubConfig {
    /// Probability that a delivered copy of a frame is lost.
    pub loss: f64,
    /// Delay from transmission to arrival.
    pub delay: Duration,
    /// Largest Ethernet payload (without the 14-byte header).
    pub mtu: usize,
    /// Frames a port's receive queue holds; more are dropped (a full switch buffer).
    pub queue_frames: usize,
    /// Seed of the loss decisions.
    pub seed: u64,
}

impl Default for HubConfig {
    fn default() -> Self {
        HubConfig { loss: 0.0, delay: Duration::ZERO, mtu: 1500, queue_frames: 65_536, seed: 0 }
    }
}

/// What the hub did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HubStats {
    /// Copies delivered to a receive queue.
    pub delivered: u64,
    /// Copies lost at random.
    pub lost: u64,
    /// Copies dropped because a link was cut.
    pub cut: u64,
    /// Copies dropped because a receive queue was full.
    pub overflow: u64,
    /// Frames flooded (destination unknown, broadcast or multicast).
    pub flooded: u64,
}

struct Slot {
    mac: MacAddr,
    queue: VecDeque<(Instant, Vec<u8>)>,
    up: bool,
    /// Whether frames toward this port are delivered (a one-way fault when `up` stays true).
    rx_up: bool,
}

struct State {
    config: HubConfig,
    slots: Vec<Slot>,
    learned: HashMap<MacAddr, usize>,
    rng: ChaCha8Rng,
    stats: HubStats,
}

struct Inner {
    state: Mutex<State>,
    /// Signalled whenever a frame is queued anywhere.
    arrived: Condvar,
}

/// A switch; [`Hub::port`] plugs a new port into it. Cheap to clone.
#[derive(Clone)]
pub struct Hub {
    inner: Arc<Inner>,
}

impl core::fmt::Debug for Hub {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Hub").finish_non_exhaustive()
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Hub {
    /// A hub with no ports.
    pub fn new(config: HubConfig) -> Result<Hub> {
        if !(0.0..=1.0).contains(&config.loss) {
            return Err(PortError::BadSpec {
                spec: format!("loss={}", config.loss),
                why: "a probability must be between 0 and 1".into(),
            });
        }
        let rng = ChaCha8Rng::seed_from_u64(config.seed);
        let state =
            State { config, slots: Vec::new(), learned: HashMap::new(), rng, stats: HubStats::default() };
        Ok(Hub { inner: Arc::new(Inner { state: Mutex::new(state), arrived: Condvar::new() }) })
    }

    /// Plugs in a port with MAC `mac`.
    pub fn port(&self, mac: MacAddr) -> HubPort {
        let mut st = lock(&self.inner.state);
        st.slots.push(Slot { mac, queue: VecDeque::new(), up: true, rx_up: true });
        HubPort {
            inner: self.inner.clone(),
            index: st.slots.len() - 1,
            mac,
            counters: PortCounters::default(),
        }
    }

    /// Cuts (`false`) or restores (`true`) the link of the port with MAC `mac`.
    pub fn set_link(&self, mac: MacAddr, up: bool) {
        let mut st = lock(&self.inner.state);
        for s in st.slots.iter_mut().filter(|s| s.mac == mac) {
            s.up = up;
            if !up {
                s.queue.clear();
            }
        }
    }

    /// Drops (`false`) or delivers again (`true`) the frames toward the port with MAC `mac`,
    /// while its own frames still go out: a one-way failure.
    pub fn set_receive(&self, mac: MacAddr, up: bool) {
        let mut st = lock(&self.inner.state);
        for s in st.slots.iter_mut().filter(|s| s.mac == mac) {
            s.rx_up = up;
        }
    }

    /// What the hub did so far.
    pub fn stats(&self) -> HubStats {
        lock(&self.inner.state).stats
    }
}

/// One port of a [`Hub`].
pub struct HubPort {
    inner: Arc<Inner>,
    index: usize,
    mac: MacAddr,
    counters: PortCounters,
}

impl core::fmt::Debug for HubPort {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("HubPort").field("mac", &self.mac).finish_non_exhaustive()
    }
}

impl HubPort {
    fn deliver(&self, st: &mut State, frame: &[u8], now: Instant) {
        if frame.len() < 14 {
            return;
        }
        let dst = MacAddr([frame[0], frame[1], frame[2], frame[3], frame[4], frame[5]]);
        let src = MacAddr([frame[6], frame[7], frame[8], frame[9], frame[10], frame[11]]);
        if !st.slots[self.index].up {
            st.stats.cut += 1;
            return;
        }
        if !src.is_multicast() {
            st.learned.insert(src, self.index);
        }
        let targets: Vec<usize> = match st.learned.get(&dst) {
            Some(&i) if !dst.is_multicast() => vec![i],
            _ => {
                st.stats.flooded += 1;
                (0..st.slots.len()).filter(|&i| i != self.index).collect()
            }
        };
        let arrive = now + st.config.delay;
        for i in targets {
            if i == self.index {
                continue;
            }
            let loss = st.config.loss;
            if loss > 0.0 && st.rng.random::<f64>() < loss {
                st.stats.lost += 1;
                continue;
            }
            let limit = st.config.queue_frames;
            let slot = &mut st.slots[i];
            if !slot.up || !slot.rx_up {
                st.stats.cut += 1;
            } else if slot.queue.len() >= limit {
                st.stats.overflow += 1;
            } else {
                slot.queue.push_back((arrive, frame.to_vec()));
                st.stats.delivered += 1;
            }
        }
    }
}

impl Port for HubPort {
    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> Result<usize> {
        let now = Instant::now();
        let frames: Vec<Vec<u8>> = {
            let mut st = lock(&self.inner.state);
            let q = &mut st.slots[self.index].queue;
            let mut out = Vec::new();
            while out.len() < max && q.front().is_some_and(|(t, _)| *t <= now) {
                out.push(q.pop_front().expect("peeked").1);
            }
            out
        };
        for f in &frames {
            self.counters.rx_frames += 1;
            self.counters.rx_bytes += f.len() as u64;
            on_frame(f);
        }
        Ok(frames.len())
    }

    fn tx_burst(&mut self, max: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> Result<usize> {
        let capacity = self.frame_capacity();
        let mut buf = vec![0u8; capacity];
        let mut sent = 0;
        while sent < max {
            let Some(len) = fill(&mut buf) else { break };
            if len > capacity {
                self.counters.tx_dropped += 1;
                return Err(PortError::Misuse(format!("frame of {len} bytes exceeds capacity {capacity}")));
            }
            {
                let mut st = lock(&self.inner.state);
                self.deliver(&mut st, &buf[..len], Instant::now());
            }
            sent += 1;
            self.counters.tx_frames += 1;
            self.counters.tx_bytes += len as u64;
        }
        if sent > 0 {
            self.inner.arrived.notify_all();
        }
        Ok(sent)
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<()> {
        let start = Instant::now();
        let deadline = timeout.map(|t| start + t);
        let mut st = lock(&self.inner.state);
        loop {
            let now = Instant::now();
            let next = st.slots[self.index].queue.front().map(|(t, _)| *t);
            if next.is_some_and(|t| t <= now) || deadline.is_some_and(|d| d <= now) {
                return Ok(());
            }
            let until = match (next, deadline) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            st = match until {
                Some(t) => self.inner.arrived.wait_timeout(st, t - now).unwrap_or_else(|e| e.into_inner()).0,
                None => self.inner.arrived.wait(st).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }

    fn mtu(&self) -> usize {
        lock(&self.inner.state).config.mtu
    }

    fn mac(&self) -> MacAddr {
        self.mac
    }

    fn counters(&self) -> PortCounters {
        self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: MacAddr = MacAddr([2, 0, 0, 0, 0, 1]);
    const B: MacAddr = MacAddr([2, 0, 0, 0, 0, 2]);
    const C: MacAddr = MacAddr([2, 0, 0, 0, 0, 3]);

    fn frame(dst: MacAddr, src: MacAddr, n: u8) -> Vec<u8> {
        let mut f = vec![0u8; 60];
        f[0..6].copy_from_slice(&dst.0);
        f[6..12].copy_from_slice(&src.0);
        f[14] = n;
        f
    }

    fn drain(p: &mut HubPort) -> Vec<u8> {
        let mut got = Vec::new();
        p.rx_burst(100, &mut |f| got.push(f[14])).unwrap();
        got
    }

    #[test]
    fn floods_unknown_then_forwards_learned() {
        let hub = Hub::new(HubConfig::default()).unwrap();
        let (mut a, mut b, mut c) = (hub.port(A), hub.port(B), hub.port(C));
        // B is unknown: flooded to B and C.
        a.send_frames(&[&frame(B, A, 1)]).unwrap();
        assert_eq!(drain(&mut b), vec![1]);
        assert_eq!(drain(&mut c), vec![1]);
        // A is learned now: B's answer goes to A only.
        b.send_frames(&[&frame(A, B, 2)]).unwrap();
        assert_eq!(drain(&mut a), vec![2]);
        assert!(drain(&mut c).is_empty());
        // Broadcast reaches everyone else.
        c.send_frames(&[&frame(MacAddr::BROADCAST, C, 3)]).unwrap();
        assert_eq!(drain(&mut a), vec![3]);
        assert_eq!(drain(&mut b), vec![3]);
        assert!(drain(&mut c).is_empty());
    }

    #[test]
    fn a_cut_link_drops_both_ways_and_loss_is_seeded() {
        let hub = Hub::new(HubConfig::default()).unwrap();
        let (mut a, mut b) = (hub.port(A), hub.port(B));
        hub.set_link(B, false);
        a.send_frames(&[&frame(B, A, 1)]).unwrap();
        b.send_frames(&[&frame(A, B, 2)]).unwrap();
        assert!(drain(&mut a).is_empty() && drain(&mut b).is_empty());
        assert_eq!(hub.stats().cut, 2);
        hub.set_link(B, true);
        a.send_frames(&[&frame(B, A, 3)]).unwrap();
        assert_eq!(drain(&mut b), vec![3]);

        let lossy = |seed| {
            let hub = Hub::new(HubConfig { loss: 0.3, seed, ..HubConfig::default() }).unwrap();
            let (mut a, mut b) = (hub.port(A), hub.port(B));
            for n in 0..100 {
                a.send_frames(&[&frame(B, A, n)]).unwrap();
            }
            drain(&mut b)
        };
        let (x, y) = (lossy(7), lossy(7));
        assert_eq!(x, y);
        assert!(x.len() > 50 && x.len() < 90, "{} of 100 arrived", x.len());
    }

    #[test]
    fn wait_returns_when_a_frame_arrives() {
        let hub = Hub::new(HubConfig::default()).unwrap();
        let (mut a, mut b) = (hub.port(A), hub.port(B));
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            a.send_frames(&[&frame(B, A, 9)]).unwrap();
        });
        let start = Instant::now();
        b.wait(Some(Duration::from_secs(5))).unwrap();
        assert!(start.elapsed() < Duration::from_secs(4));
        assert_eq!(drain(&mut b), vec![9]);
        t.join().unwrap();
    }
}
