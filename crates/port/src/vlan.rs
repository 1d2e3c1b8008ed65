//! Groups as 802.1Q VLANs: a wrapper around a port that sends raw Ethernet frames which tags
//! every frame it sends with the node's group as the VLAN ID and takes only frames tagged with
//! it, so a standard switch configured with VLANs keeps groups apart (NEC's ExpEther hardware maps
//! a group to a VLAN the same way).
//!
//! Layer: ports. The tag (TPID 0x8100, priority 0, VLAN ID = group) goes between the source MAC
//! and the EtherType on transmit and comes off on receive, so everything above sees untagged
//! frames. The VLAN ID is a [`VlanId`] handle the runtime moves when the node's group changes
//! (`lanbus device-ctl ... group N`): from the next frame on the node lives in the new VLAN.
//! The frames the wrapper carries are 4 bytes shorter than the inner port's (its MTU is the inner
//! one less the tag), so a tagged frame never exceeds what the link takes.
//!
//! Invariants: an untagged frame, a frame of another VLAN and a frame too short to hold a tag are
//! filtered out and counted (in `rx_filtered`, and in [`VlanCounters`]); nothing is passed up with
//! its tag. AF_PACKET hands a received tag over beside the frame (`tp_vlan_tci`), not in its bytes:
//! the afpacket port puts it back into the frame, so this wrapper sees the same bytes on every
//! port. Groups above 4094 have no VLAN ID: [`VlanId::set`] refuses them.

use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::Arc;

use crate::{Port, PortCounters, Result};

/// The 802.1Q tag protocol identifier.
pub const TPID: u16 = 0x8100;
/// Bytes of a tag.
pub const TAG_LEN: usize = 4;
/// The largest VLAN ID (4095 is reserved).
pub const MAX_VID: u16 = 4094;

/// The VLAN a [`VlanPort`] sends and receives in; shared with the runtime, which moves it with the
/// node's group.
#[derive(Debug, Clone, Default)]
pub struct VlanId(Arc<AtomicU16>);

impl VlanId {
    /// The current VLAN ID.
    pub fn get(&self) -> u16 {
        // Relaxed: a frame tagged with the old ID a moment after the change is what a change of
        // group means anyway; nothing else is published through it.
        self.0.load(Ordering::Relaxed)
    }

    /// Moves to VLAN `vid`; refused (and nothing changes) above [`MAX_VID`].
    pub fn set(&self, vid: u16) -> core::result::Result<(), String> {
        if vid > MAX_VID {
            return Err(format!("group {vid} has no VLAN ID (802.1Q IDs go up to {MAX_VID})"));
        }
        self.0.store(vid, Ordering::Relaxed);
        Ok(())
    }
}

/// Frames the wrapper dropped.
#[derive(Debug, Default)]
pub struct VlanCounters {
    untagged: AtomicU64,
    other_vlan: AtomicU64,
}

impl VlanCounters {
    /// Received frames without a tag.
    pub fn untagged(&self) -> u64 {
        self.untagged.load(Ordering::Relaxed)
    }

    /// Received frames tagged with another VLAN.
    pub fn other_vlan(&self) -> u64 {
        self.other_vlan.load(Ordering::Relaxed)
    }
}

/// The VLAN ID of a frame's 802.1Q tag (`None` if it has none).
pub fn frame_vid(frame: &[u8]) -> Option<u16> {
    (frame.len() >= 14 + TAG_LEN && u16::from_be_bytes([frame[12], frame[13]]) == TPID)
        .then(|| u16::from_be_bytes([frame[14], frame[15]]) & 0x0fff)
}

/// Inserts a tag with `vid` into an untagged frame of `len` bytes at the start of `buf` (which
/// has room for 4 more); returns the new length.
pub fn insert_tag(buf: &mut [u8], len: usize, vid: u16) -> usize {
    buf.copy_within(12..len, 12 + TAG_LEN);
    buf[12..14].copy_from_slice(&TPID.to_be_bytes());
    buf[14..16].copy_from_slice(&(vid & 0x0fff).to_be_bytes());
    len + TAG_LEN
}

/// A port whose frames carry the node's group as their 802.1Q VLAN ID.
pub struct VlanPort<P: Port = Box<dyn Port>> {
    inner: P,
    vid: VlanId,
    counters: Arc<VlanCounters>,
    /// A received frame without its tag.
    scratch: Vec<u8>,
}

impl<P: Port> VlanPort<P> {
    /// Wraps `inner`, starting in VLAN 0 until the runtime sets the group.
    pub fn new(inner: P) -> VlanPort<P> {
        VlanPort { inner, vid: VlanId::default(), counters: Arc::default(), scratch: Vec::new() }
    }

    /// The handle that moves the port to another VLAN.
    pub fn vlan_id(&self) -> VlanId {
        self.vid.clone()
    }

    /// The drop counters (readable after the port moved into a runtime).
    pub fn vlan_counters(&self) -> Arc<VlanCounters> {
        self.counters.clone()
    }
}

// Overridden: the tag comes off on receive and goes on in `tx_burst` (through which every transmit
// path copies: `REWRITES_TX`), the MTU and frame capacity lose the tag's bytes,
// and the counters add the filtered frames. Everything else forwards (see `crate::layer`).
impl<P: Port> crate::Layer for VlanPort<P> {
    type Inner = P;

    /// Every frame gets its tag in the inner port's buffer.
    const REWRITES_TX: bool = true;

    fn inner(&self) -> &P {
        &self.inner
    }

    fn inner_mut(&mut self) -> &mut P {
        &mut self.inner
    }

    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> Result<usize> {
        Port::rx_burst_stamped(self, max, &mut |f, _| on_frame(f))
    }

    fn rx_burst_stamped(
        &mut self,
        max: usize,
        on_frame: &mut dyn FnMut(&[u8], Option<u64>),
    ) -> Result<usize> {
        let VlanPort { inner, vid, counters, scratch } = self;
        let want = vid.get();
        let mut delivered = 0;
        inner.rx_burst_stamped(max, &mut |frame, stamp| match frame_vid(frame) {
            Some(v) if v == want => {
                scratch.clear();
                scratch.extend_from_slice(&frame[..12]);
                scratch.extend_from_slice(&frame[12 + TAG_LEN..]);
                delivered += 1;
                on_frame(scratch, stamp);
            }
            Some(_) => {
                counters.other_vlan.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                counters.untagged.fetch_add(1, Ordering::Relaxed);
            }
        })?;
        Ok(delivered)
    }

    fn tx_burst(&mut self, max: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> Result<usize> {
        let vid = self.vid.get();
        self.inner.tx_burst(max, &mut |buf| {
            let room = buf.len().checked_sub(TAG_LEN)?;
            let n = fill(&mut buf[..room])?;
            if n < 14 {
                return Some(n);
            }
            Some(insert_tag(buf, n, vid))
        })
    }

    fn mtu(&self) -> usize {
        self.inner.mtu() - TAG_LEN
    }

    fn frame_capacity(&self) -> usize {
        self.inner.frame_capacity() - TAG_LEN
    }

    fn counters(&self) -> PortCounters {
        let mut c = self.inner.counters();
        c.rx_filtered += self.counters.untagged() + self.counters.other_vlan();
        c
    }

    fn vlan(&self) -> Option<VlanId> {
        Some(self.vid.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Hub, HubConfig};
    use lanbus_wire::MacAddr;
    use proptest::prelude::*;

    fn mac(n: u8) -> MacAddr {
        MacAddr([2, 0, 0, 0, 0x7a, n])
    }

    fn frame(dst: MacAddr, src: MacAddr, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&dst.0);
        f.extend_from_slice(&src.0);
        f.extend_from_slice(&0x88b5u16.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn send(p: &mut dyn Port, f: &[u8]) {
        let mut once = Some(f.to_vec());
        let sent = p
            .tx_burst(1, &mut |buf| {
                let f = once.take()?;
                buf[..f.len()].copy_from_slice(&f);
                Some(f.len())
            })
            .unwrap();
        assert_eq!(sent, 1);
    }

    fn receive(p: &mut dyn Port) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        for _ in 0..3 {
            p.rx_burst(64, &mut |f| got.push(f.to_vec())).unwrap();
        }
        got
    }

    #[test]
    fn groups_are_vlans_on_the_hub_and_the_tag_never_reaches_the_caller() {
        let hub = Hub::new(HubConfig::default()).unwrap();
        let mut a = VlanPort::new(Box::new(hub.port(mac(1))));
        let mut b = VlanPort::new(Box::new(hub.port(mac(2))));
        let mut c = VlanPort::new(Box::new(hub.port(mac(3))));
        let mut plain = hub.port(mac(4));
        a.vlan_id().set(7).unwrap();
        b.vlan_id().set(7).unwrap();
        c.vlan_id().set(8).unwrap();
        let bcast = MacAddr([0xff; 6]);
        let f = frame(bcast, mac(1), b"hello group 7");
        send(&mut a, &f);
        assert_eq!(receive(&mut b), vec![f.clone()], "same VLAN: delivered, untagged");
        assert!(receive(&mut c).is_empty(), "another VLAN: dropped");
        assert_eq!(c.vlan_counters().other_vlan(), 1);
        let on_wire = receive(&mut plain);
        assert_eq!(on_wire.len(), 1);
        assert_eq!(frame_vid(&on_wire[0]), Some(7), "tagged on the wire");
        assert_eq!(on_wire[0].len(), f.len() + TAG_LEN);
        // An untagged frame reaches no VLAN port.
        send(&mut plain, &frame(bcast, mac(4), b"untagged"));
        assert!(receive(&mut a).is_empty() && receive(&mut b).is_empty());
        assert_eq!(a.vlan_counters().untagged(), 1);
        assert_eq!(a.counters().rx_filtered, 1);
        // Moving c into VLAN 7 (a change of group) lets it hear a.
        c.vlan_id().set(7).unwrap();
        send(&mut a, &f);
        assert_eq!(receive(&mut c), vec![f]);
        assert!(c.vlan_id().set(4095).is_err());
        assert_eq!(c.vlan_id().get(), 7);
        assert_eq!(a.mtu(), hub.port(mac(9)).mtu() - TAG_LEN);
    }

    proptest! {
        #[test]
        fn a_tag_goes_in_and_comes_out_leaving_the_frame_as_it_was(
            vid in 0u16..=MAX_VID, payload in proptest::collection::vec(any::<u8>(), 0..64)
        ) {
            let f = frame(mac(1), mac(2), &payload);
            let mut buf = f.clone();
            buf.resize(f.len() + TAG_LEN, 0);
            let n = insert_tag(&mut buf, f.len(), vid);
            prop_assert_eq!(frame_vid(&buf[..n]), Some(vid));
            let back: Vec<u8> = buf[..12].iter().chain(&buf[16..n]).copied().collect();
            prop_assert_eq!(back, f);
        }

        #[test]
        fn any_bytes_give_a_vid_or_none_without_panic(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Some(v) = frame_vid(&bytes) {
                prop_assert!(v <= 0x0fff);
            }
        }
    }
}
