//! Layers: ports that wrap another port (fault injection, 802.1Q tagging) and change only part of
//! what passes through.
//!
//! Layer: ports. A [`Layer`] names its inner port and overrides the [`Port`] methods where it does
//! something; every method it leaves alone forwards to the inner port, through the blanket
//! `impl<W: Layer> Port for W`. The forwarding is written once, here, for every layer.
//!
//! Invariants: a default forwards to the same method of the inner port, unchanged, except where
//! forwarding could let a frame past the layer: [`Layer::send_frames`] always sends through the
//! layer's own [`Layer::tx_burst`], and a layer that rewrites or drops frames on the way out sets
//! [`Layer::REWRITES_TX`], so that every transmit method goes through its `tx_burst` too (it then
//! borrows no frames and refuses segmentation offload). A layer that changes frames on the way in
//! overrides both [`Layer::rx_burst`] and [`Layer::rx_burst_stamped`]; one that changes the frames'
//! size overrides [`Layer::mtu`] and [`Layer::frame_capacity`].

use core::time::Duration;

use lanbus_wire::MacAddr;

use crate::vlan::VlanId;
use crate::{Gso, Port, PortCounters, Result};

/// A port over an inner port; see the module docs. Implement it instead of [`Port`]: the blanket
/// implementation makes every layer a port.
pub trait Layer: Send + Sized {
    /// The wrapped port.
    type Inner: Port + ?Sized;

    /// Whether the layer rewrites or drops frames in [`Layer::tx_burst`], so that every frame sent
    /// must pass through it: then the defaults of [`Layer::tx_borrowed`] and
    /// [`Layer::tx_borrowed_parts`] copy through `tx_burst`, [`Layer::borrows_frames`] is false and
    /// [`Layer::tx_gso`] is refused. By default (false) they forward to the inner port.
    const REWRITES_TX: bool = false;

    /// The wrapped port.
    fn inner(&self) -> &Self::Inner;

    /// The wrapped port, mutably.
    fn inner_mut(&mut self) -> &mut Self::Inner;

    /// [`Port::rx_burst`]; forwards by default.
    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> Result<usize> {
        Port::rx_burst(self.inner_mut(), max, on_frame)
    }

    /// [`Port::rx_burst_stamped`]; forwards by default.
    fn rx_burst_stamped(
        &mut self,
        max: usize,
        on_frame: &mut dyn FnMut(&[u8], Option<u64>),
    ) -> Result<usize> {
        Port::rx_burst_stamped(self.inner_mut(), max, on_frame)
    }

    /// [`Port::tx_burst`]; forwards by default.
    fn tx_burst(&mut self, max: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> Result<usize> {
        Port::tx_burst(self.inner_mut(), max, fill)
    }

    /// [`Port::borrows_frames`]; forwards by default (false where [`Layer::REWRITES_TX`]).
    fn borrows_frames(&self) -> bool {
        !Self::REWRITES_TX && Port::borrows_frames(self.inner())
    }

    /// [`Port::tx_borrowed`]; forwards by default (copies through [`Layer::tx_burst`] where
    /// [`Layer::REWRITES_TX`]).
    fn tx_borrowed(&mut self, frames: &[&[u8]]) -> Result<usize> {
        if Self::REWRITES_TX {
            return crate::copy_frames(self, frames);
        }
        Port::tx_borrowed(self.inner_mut(), frames)
    }

    /// [`Port::tx_borrowed_parts`]; forwards by default (copies through [`Layer::tx_burst`] where
    /// [`Layer::REWRITES_TX`]).
    fn tx_borrowed_parts(&mut self, frames: &[[&[u8]; 2]]) -> Result<usize> {
        if Self::REWRITES_TX {
            return crate::copy_parts(self, frames);
        }
        Port::tx_borrowed_parts(self.inner_mut(), frames)
    }

    /// [`Port::tx_gso`]; forwards by default (refused where [`Layer::REWRITES_TX`]: the inner port
    /// would send the segments without the layer seeing them).
    fn tx_gso(&mut self, frame: &[u8], gso: Gso) -> Result<bool> {
        if Self::REWRITES_TX {
            return Ok(false);
        }
        Port::tx_gso(self.inner_mut(), frame, gso)
    }

    /// [`Port::send_frames`]: copies the frames through the layer's own [`Layer::tx_burst`] (what
    /// the inner port's would do with its own), so that no layer is bypassed.
    fn send_frames(&mut self, frames: &[&[u8]]) -> Result<usize> {
        crate::copy_frames(self, frames)
    }

    /// [`Port::wait`]; forwards by default.
    fn wait(&mut self, timeout: Option<Duration>) -> Result<()> {
        Port::wait(self.inner_mut(), timeout)
    }

    /// [`Port::mtu`]; forwards by default.
    fn mtu(&self) -> usize {
        Port::mtu(self.inner())
    }

    /// [`Port::frame_capacity`]; forwards by default.
    fn frame_capacity(&self) -> usize {
        Port::frame_capacity(self.inner())
    }

    /// [`Port::readiness_fd`]; forwards by default.
    fn readiness_fd(&self) -> Option<std::os::fd::RawFd> {
        Port::readiness_fd(self.inner())
    }

    /// [`Port::arm_readiness`]; forwards by default.
    fn arm_readiness(&mut self) -> bool {
        Port::arm_readiness(self.inner_mut())
    }

    /// [`Port::disarm_readiness`]; forwards by default.
    fn disarm_readiness(&mut self) {
        Port::disarm_readiness(self.inner_mut())
    }

    /// [`Port::mac`]; forwards by default.
    fn mac(&self) -> MacAddr {
        Port::mac(self.inner())
    }

    /// [`Port::vlan`]; forwards by default.
    fn vlan(&self) -> Option<VlanId> {
        Port::vlan(self.inner())
    }

    /// [`Port::authenticates`]; forwards by default.
    fn authenticates(&self) -> bool {
        Port::authenticates(self.inner())
    }

    /// [`Port::counters`]; forwards by default.
    fn counters(&self) -> PortCounters {
        Port::counters(self.inner())
    }

    /// [`Port::take_failed_peer`]; forwards by default.
    fn take_failed_peer(&mut self) -> Option<MacAddr> {
        Port::take_failed_peer(self.inner_mut())
    }

    /// [`Port::paths`]; forwards by default.
    fn paths(&self) -> Vec<crate::PathReport> {
        Port::paths(self.inner())
    }
}

impl<W: Layer> Port for W {
    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> Result<usize> {
        Layer::rx_burst(self, max, on_frame)
    }
    fn rx_burst_stamped(
        &mut self,
        max: usize,
        on_frame: &mut dyn FnMut(&[u8], Option<u64>),
    ) -> Result<usize> {
        Layer::rx_burst_stamped(self, max, on_frame)
    }
    fn tx_burst(&mut self, max: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> Result<usize> {
        Layer::tx_burst(self, max, fill)
    }
    fn borrows_frames(&self) -> bool {
        Layer::borrows_frames(self)
    }
    fn tx_borrowed(&mut self, frames: &[&[u8]]) -> Result<usize> {
        Layer::tx_borrowed(self, frames)
    }
    fn tx_borrowed_parts(&mut self, frames: &[[&[u8]; 2]]) -> Result<usize> {
        Layer::tx_borrowed_parts(self, frames)
    }
    fn tx_gso(&mut self, frame: &[u8], gso: Gso) -> Result<bool> {
        Layer::tx_gso(self, frame, gso)
    }
    fn send_frames(&mut self, frames: &[&[u8]]) -> Result<usize> {
        Layer::send_frames(self, frames)
    }
    fn wait(&mut self, timeout: Option<Duration>) -> Result<()> {
        Layer::wait(self, timeout)
    }
    fn mtu(&self) -> usize {
        Layer::mtu(self)
    }
    fn frame_capacity(&self) -> usize {
        Layer::frame_capacity(self)
    }
    fn readiness_fd(&self) -> Option<std::os::fd::RawFd> {
        Layer::readiness_fd(self)
    }
    fn arm_readiness(&mut self) -> bool {
        Layer::arm_readiness(self)
    }
    fn disarm_readiness(&mut self) {
        Layer::disarm_readiness(self)
    }
    fn mac(&self) -> MacAddr {
        Layer::mac(self)
    }
    fn vlan(&self) -> Option<VlanId> {
        Layer::vlan(self)
    }
    fn authenticates(&self) -> bool {
        Layer::authenticates(self)
    }
    fn counters(&self) -> PortCounters {
        Layer::counters(self)
    }
    fn take_failed_peer(&mut self) -> Option<MacAddr> {
        Layer::take_failed_peer(self)
    }
    fn paths(&self) -> Vec<crate::PathReport> {
        Layer::paths(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port that keeps what it is sent and says whether it was borrowed or copied.
    #[derive(Default)]
    struct Sink {
        copied: Vec<Vec<u8>>,
        borrowed: Vec<Vec<u8>>,
    }

    impl Port for Sink {
        fn rx_burst(&mut self, _: usize, _: &mut dyn FnMut(&[u8])) -> Result<usize> {
            Ok(0)
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
                self.copied.push(buf[..len].to_vec());
                n += 1;
            }
            Ok(n)
        }
        fn borrows_frames(&self) -> bool {
            true
        }
        fn tx_borrowed(&mut self, frames: &[&[u8]]) -> Result<usize> {
            self.borrowed.extend(frames.iter().map(|f| f.to_vec()));
            Ok(frames.len())
        }
        fn tx_gso(&mut self, _: &[u8], _: Gso) -> Result<bool> {
            Ok(true)
        }
        fn wait(&mut self, _: Option<Duration>) -> Result<()> {
            Ok(())
        }
        fn mtu(&self) -> usize {
            50
        }
        fn mac(&self) -> MacAddr {
            MacAddr::local(7)
        }
        fn counters(&self) -> PortCounters {
            PortCounters { tx_frames: (self.copied.len() + self.borrowed.len()) as u64, ..Default::default() }
        }
    }

    /// A layer that changes nothing, or (`REWRITES`) one that upper-cases what it sends.
    struct Over<const REWRITES: bool>(Sink);

    impl<const REWRITES: bool> Layer for Over<REWRITES> {
        type Inner = Sink;
        const REWRITES_TX: bool = REWRITES;
        fn inner(&self) -> &Sink {
            &self.0
        }
        fn inner_mut(&mut self) -> &mut Sink {
            &mut self.0
        }
        fn tx_burst(
            &mut self,
            max: usize,
            fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
        ) -> Result<usize> {
            Port::tx_burst(&mut self.0, max, &mut |buf| {
                let n = fill(buf)?;
                buf[..n].make_ascii_uppercase();
                Some(n)
            })
        }
    }

    const GSO: Gso = Gso { segment_bytes: 1, csum_start: 0, csum_offset: 0, header_bytes: 0, ipv6: false };

    #[test]
    fn a_layer_forwards_what_it_leaves_alone() {
        let mut over = Over::<false>(Sink::default());
        // Through `dyn Port`, as a runtime holds it (here `Layer` is in scope as well).
        let port: &mut dyn Port = &mut over;
        assert_eq!((port.mtu(), port.frame_capacity(), port.mac()), (50, 64, MacAddr::local(7)));
        assert!(port.borrows_frames() && port.tx_gso(b"x", GSO).unwrap());
        assert_eq!(port.tx_borrowed(&[b"lent"]).unwrap(), 1);
        // send_frames goes through the layer's tx_burst, whatever the layer.
        assert_eq!(port.send_frames(&[b"sent"]).unwrap(), 1);
        assert_eq!(port.counters().tx_frames, 2);
        assert!(port.vlan().is_none() && port.readiness_fd().is_none() && port.arm_readiness());
        assert_eq!((over.0.borrowed, over.0.copied), (vec![b"lent".to_vec()], vec![b"SENT".to_vec()]));
    }

    #[test]
    fn a_layer_that_rewrites_what_it_sends_sees_every_frame() {
        let mut over = Over::<true>(Sink::default());
        let port: &mut dyn Port = &mut over;
        assert!(!port.borrows_frames() && !port.tx_gso(b"x", GSO).unwrap());
        assert_eq!(port.tx_borrowed(&[b"lent"]).unwrap(), 1);
        assert_eq!(port.tx_borrowed_parts(&[[b"he", b"ad"]]).unwrap(), 1);
        assert_eq!(port.send_frames(&[b"sent"]).unwrap(), 1);
        assert!(over.0.borrowed.is_empty());
        assert_eq!(over.0.copied, [b"LENT".to_vec(), b"HEAD".to_vec(), b"SENT".to_vec()]);
    }
}
