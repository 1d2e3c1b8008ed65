//! A fault-injecting wrapper around any port: seeded random loss on receive and on transmit.
//!
//! Layer: ports (a test and measurement aid, in the spirit of smoltcp's `FaultInjector`). The
//! lanbus side injects loss on real ports, so the transport's recovery (Go-Back-N, fast
//! retransmit, timeouts) runs over real packet I/O without touching the kernel's qdiscs.
//!
//! Invariants: the loss decisions come from a ChaCha generator seeded by the caller, one draw per
//! frame in the order the frames pass (so a single-threaded sequence of bursts is reproducible);
//! a frame dropped on receive is never shown to the callback; a frame dropped on transmit is
//! filled by the caller (it is consumed, as a lossy wire would) but never handed to the inner
//! port, whose buffer is reused for the next frame. Every injected drop is counted, both in the
//! port's [`PortCounters`] (`rx_dropped`, `tx_dropped`) and in a [`FaultCounters`] handle that
//! stays readable after the port is moved into a runtime.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{Port, PortCounters, Result};

/// What to inject.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultConfig {
    /// Probability that a received frame is dropped before the caller sees it (0.0..=1.0).
    pub rx_loss: f64,
    /// Probability that a frame the caller filled is dropped instead of sent (0.0..=1.0).
    pub tx_loss: f64,
    /// Seed of the loss generator.
    pub seed: u64,
}

impl FaultConfig {
    /// The same loss rate on receive and transmit.
    pub fn loss(rate: f64, seed: u64) -> Self {
        FaultConfig { rx_loss: rate, tx_loss: rate, seed }
    }
}

/// Frames dropped on purpose; shared by the port and its handles.
#[derive(Debug, Default)]
pub struct FaultCounters {
    rx_dropped: AtomicU64,
    tx_dropped: AtomicU64,
}

impl FaultCounters {
    /// Received frames dropped by injection.
    pub fn rx_dropped(&self) -> u64 {
        // Relaxed: a statistic; nothing else is published through it.
        self.rx_dropped.load(Ordering::Relaxed)
    }

    /// Transmitted frames dropped by injection.
    pub fn tx_dropped(&self) -> u64 {
        // Relaxed: as above.
        self.tx_dropped.load(Ordering::Relaxed)
    }
}

/// A port that loses frames at random (seeded) on the way in and out.
pub struct FaultyPort<P: Port> {
    inner: P,
    config: FaultConfig,
    rng: ChaCha8Rng,
    counters: Arc<FaultCounters>,
}

impl<P: Port> FaultyPort<P> {
    /// Wraps `inner`. Loss rates are clamped to 0..=1 (NaN counts as 0).
    pub fn new(inner: P, config: FaultConfig) -> Self {
        let clamp = |p: f64| if p.is_nan() { 0.0 } else { p.clamp(0.0, 1.0) };
        let config = FaultConfig { rx_loss: clamp(config.rx_loss), tx_loss: clamp(config.tx_loss), ..config };
        FaultyPort {
            inner,
            rng: ChaCha8Rng::seed_from_u64(config.seed),
            config,
            counters: Arc::new(FaultCounters::default()),
        }
    }

    /// A handle on the injected-drop counters that outlives moving the port elsewhere.
    pub fn fault_counters(&self) -> Arc<FaultCounters> {
        self.counters.clone()
    }

    /// The wrapped port.
    pub fn inner(&self) -> &P {
        &self.inner
    }

    /// Whether the next frame sent is lost (counted as dropped if so).
    fn lose_one(&mut self) -> bool {
        let lost = self.config.tx_loss > 0.0 && self.rng.random_bool(self.config.tx_loss);
        if lost {
            // Relaxed: a statistic.
            self.counters.tx_dropped.fetch_add(1, Ordering::Relaxed);
        }
        lost
    }
}

// Only the data path is overridden: loss on receive and on transmit (every transmit method that
// forwards by default, so that no frame reaches the inner port without its draw), and the counters
// that add the injected drops.
// Everything else forwards to the inner port (see `crate::layer`).
impl<P: Port> crate::Layer for FaultyPort<P> {
    type Inner = P;

    fn inner(&self) -> &P {
        &self.inner
    }

    fn inner_mut(&mut self) -> &mut P {
        &mut self.inner
    }

    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> Result<usize> {
        Port::rx_burst_stamped(self, max, &mut |frame, _| on_frame(frame))
    }

    fn rx_burst_stamped(
        &mut self,
        max: usize,
        on_frame: &mut dyn FnMut(&[u8], Option<u64>),
    ) -> Result<usize> {
        let (rng, loss, counters) = (&mut self.rng, self.config.rx_loss, &self.counters);
        let mut delivered = 0;
        self.inner.rx_burst_stamped(max, &mut |frame, stamp| {
            if loss > 0.0 && rng.random_bool(loss) {
                // Relaxed: a statistic.
                counters.rx_dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            delivered += 1;
            on_frame(frame, stamp);
        })?;
        Ok(delivered)
    }

    fn tx_burst(&mut self, max: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> Result<usize> {
        let (rng, loss, counters) = (&mut self.rng, self.config.tx_loss, &self.counters);
        self.inner.tx_burst(max, &mut |buf| loop {
            let len = fill(buf)?;
            if loss > 0.0 && rng.random_bool(loss) {
                // Relaxed: a statistic.
                counters.tx_dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            return Some(len);
        })
    }

    fn tx_borrowed(&mut self, frames: &[&[u8]]) -> Result<usize> {
        if !self.inner.borrows_frames() {
            return crate::copy_frames(self, frames);
        }
        let kept: Vec<&[u8]> = frames.iter().copied().filter(|_| !self.lose_one()).collect();
        self.inner.tx_borrowed(&kept)?;
        Ok(frames.len())
    }

    fn tx_borrowed_parts(&mut self, frames: &[[&[u8]; 2]]) -> Result<usize> {
        if !self.inner.borrows_frames() {
            return crate::copy_parts(self, frames);
        }
        let kept: Vec<[&[u8]; 2]> = frames.iter().copied().filter(|_| !self.lose_one()).collect();
        self.inner.tx_borrowed_parts(&kept)?;
        Ok(frames.len())
    }

    /// Refused: the caller cuts the segment into frames itself, each of which then draws its loss.
    fn tx_gso(&mut self, _frame: &[u8], _gso: crate::Gso) -> Result<bool> {
        Ok(false)
    }

    fn counters(&self) -> PortCounters {
        let mut c = self.inner.counters();
        c.rx_dropped += self.counters.rx_dropped();
        c.tx_dropped += self.counters.tx_dropped();
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::time::Duration;
    use lanbus_wire::MacAddr;
    use std::collections::VecDeque;

    /// A loopback port: what it transmits it receives.
    #[derive(Default)]
    struct Loop {
        frames: VecDeque<Vec<u8>>,
        counters: PortCounters,
        /// Whether it takes frames where they lie ([`Port::tx_borrowed`]).
        borrows: bool,
    }

    impl Port for Loop {
        fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> Result<usize> {
            let mut n = 0;
            while n < max {
                let Some(f) = self.frames.pop_front() else { break };
                on_frame(&f);
                n += 1;
            }
            Ok(n)
        }
        fn tx_burst(
            &mut self,
            max: usize,
            fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
        ) -> Result<usize> {
            let mut buf = [0u8; 64];
            let mut n = 0;
            while n < max {
                let Some(len) = fill(&mut buf) else { break };
                self.frames.push_back(buf[..len].to_vec());
                self.counters.tx_frames += 1;
                n += 1;
            }
            Ok(n)
        }
        fn borrows_frames(&self) -> bool {
            self.borrows
        }
        fn tx_borrowed(&mut self, frames: &[&[u8]]) -> Result<usize> {
            assert!(self.borrows, "borrowed frames handed to a port that copies");
            self.frames.extend(frames.iter().map(|f| f.to_vec()));
            self.counters.tx_frames += frames.len() as u64;
            Ok(frames.len())
        }
        fn wait(&mut self, _: Option<Duration>) -> Result<()> {
            Ok(())
        }
        fn mtu(&self) -> usize {
            50
        }
        fn mac(&self) -> MacAddr {
            MacAddr::local(1)
        }
        fn counters(&self) -> PortCounters {
            self.counters
        }
    }

    fn run(config: FaultConfig, n: u32) -> (Vec<u32>, u64, u64) {
        let mut port = FaultyPort::new(Loop::default(), config);
        let mut next = 0u32;
        let sent = port
            .tx_burst(n as usize, &mut |buf| {
                if next == n {
                    return None;
                }
                buf[..4].copy_from_slice(&next.to_be_bytes());
                next += 1;
                Some(4)
            })
            .unwrap();
        let mut got = Vec::new();
        let delivered =
            port.rx_burst(usize::MAX, &mut |f| got.push(u32::from_be_bytes(f.try_into().unwrap()))).unwrap();
        assert_eq!(delivered, got.len());
        assert_eq!(sent as u64 + port.fault_counters().tx_dropped(), n as u64);
        let c = port.counters();
        assert_eq!(c.tx_dropped, port.fault_counters().tx_dropped());
        assert_eq!(c.rx_dropped, port.fault_counters().rx_dropped());
        (got, c.rx_dropped, c.tx_dropped)
    }

    #[test]
    fn loss_is_seeded_counted_and_near_the_rate() {
        let (got, rx, tx) = run(FaultConfig::loss(0.1, 7), 10_000);
        assert_eq!(got.len() as u64 + rx + tx, 10_000);
        assert!((800..1200).contains(&rx) && (800..1200).contains(&tx), "rx {rx} tx {tx}");
        // In order, nothing duplicated.
        assert!(got.windows(2).all(|w| w[0] < w[1]));
        // The same seed loses the same frames; another seed others.
        assert_eq!(run(FaultConfig::loss(0.1, 7), 10_000).0, got);
        assert_ne!(run(FaultConfig::loss(0.1, 8), 10_000).0, got);
    }

    #[test]
    fn borrowed_frames_are_lost_at_the_same_rate_and_the_rest_pass_in_order() {
        for borrows in [true, false] {
            let mut port = FaultyPort::new(Loop { borrows, ..Loop::default() }, FaultConfig::loss(0.1, 7));
            assert_eq!(port.borrows_frames(), borrows);
            let frames: Vec<[u8; 4]> = (0..10_000u32).map(u32::to_be_bytes).collect();
            for chunk in frames.chunks(32) {
                let borrowed: Vec<&[u8]> = chunk.iter().map(|f| &f[..]).collect();
                let took = port.tx_borrowed(&borrowed).unwrap();
                // Borrowed, all are taken (the lost ones counted as dropped); copied, the lost
                // ones never reach the port.
                if borrows {
                    assert_eq!(took, chunk.len());
                } else {
                    assert!(took <= chunk.len());
                }
            }
            let mut got = Vec::new();
            port.rx_burst(usize::MAX, &mut |f| got.push(u32::from_be_bytes(f.try_into().unwrap()))).unwrap();
            let lost = port.fault_counters().tx_dropped();
            assert!((800..1200).contains(&lost), "borrows {borrows}: {lost} lost");
            assert_eq!(got.len() as u64 + lost + port.fault_counters().rx_dropped(), 10_000);
            assert!(got.windows(2).all(|w| w[0] < w[1]));
        }
    }

    #[test]
    fn zero_loss_passes_everything_and_odd_rates_are_clamped() {
        let (got, rx, tx) = run(FaultConfig::loss(0.0, 1), 1000);
        assert_eq!((got.len(), rx, tx), (1000, 0, 0));
        let (got, _, tx) = run(FaultConfig { rx_loss: f64::NAN, tx_loss: 2.0, seed: 1 }, 100);
        assert_eq!((got.len(), tx), (0, 100));
    }
}
