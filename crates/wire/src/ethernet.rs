//! Ethernet II frames (IEEE 802.3 with an EtherType; no 802.1Q tag).
//!
//! ```text
//!  0                   6                   12      14
//! +-------------------+-------------------+-------+------------
//! | destination MAC   | source MAC        | type  | payload ...
//! +-------------------+-------------------+-------+------------
//! ```
//! The frame check sequence is the NIC's business and never appears here.

use core::fmt;
use core::str::FromStr;

use crate::{Error, Result};

/// A 48-bit IEEE MAC address.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// ff:ff:ff:ff:ff:ff.
    pub const BROADCAST: MacAddr = MacAddr([0xff; 6]);

    /// Whether the group bit (I/G) is set: broadcast or multicast.
    pub const fn is_multicast(&self) -> bool {
        self.0[0] & 0x01 != 0
    }

    /// Whether this is the broadcast address.
    pub fn is_broadcast(&self) -> bool {
        *self == Self::BROADCAST
    }

    /// A locally administered unicast address derived from `n` (02:4c:42:xx:xx:xx, "LB"), for
    /// simulated hosts and tests.
    pub const fn local(n: u32) -> MacAddr {
        let b = n.to_be_bytes();
        MacAddr([0x02, 0x4c, 0x42, b[1], b[2], b[3]])
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(f, "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2], b[3], b[4], b[5])
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for MacAddr {
    type Err = Error;

    /// Parses `aa:bb:cc:dd:ee:ff` (hexadecimal, `:` or `-` separated).
    fn from_str(s: &str) -> Result<MacAddr> {
        let mut out = [0u8; 6];
        let mut parts = s.split([':', '-']);
        for byte in &mut out {
            let part = parts.next().ok_or(Error::Malformed { what: "MAC address" })?;
            if part.is_empty() || part.len() > 2 {
                return Err(Error::Malformed { what: "MAC address" });
            }
            *byte = u8::from_str_radix(part, 16).map_err(|_| Error::Malformed { what: "MAC address" })?;
        }
        if parts.next().is_some() {
            return Err(Error::Malformed { what: "MAC address" });
        }
        Ok(MacAddr(out))
    }
}

/// EtherType code points that lanbus cares about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EtherType {
    /// IPv4 (0x0800).
    Ipv4,
    /// ARP (0x0806).
    Arp,
    /// IPv6 (0x86DD).
    Ipv6,
    /// lanbus (0x88B5, IEEE 802 local experimental EtherType 1).
    Lanbus,
    /// Anything else.
    Unknown(u16),
}

impl EtherType {
    /// The EtherType lanbus frames carry.
    pub const LANBUS_RAW: u16 = 0x88B5;
}

impl From<u16> for EtherType {
    fn from(v: u16) -> Self {
        match v {
            0x0800 => EtherType::Ipv4,
            0x0806 => EtherType::Arp,
            0x86DD => EtherType::Ipv6,
            EtherType::LANBUS_RAW => EtherType::Lanbus,
            other => EtherType::Unknown(other),
        }
    }
}

impl From<EtherType> for u16 {
    fn from(v: EtherType) -> u16 {
        match v {
            EtherType::Ipv4 => 0x0800,
            EtherType::Arp => 0x0806,
            EtherType::Ipv6 => 0x86DD,
            EtherType::Lanbus => EtherType::LANBUS_RAW,
            EtherType::Unknown(other) => other,
        }
    }
}

mod field {
    use core::ops::{Range, RangeFrom};
    pub const DESTINATION: Range<usize> = 0..6;
    pub const SOURCE: Range<usize> = 6..12;
    pub const ETHERTYPE: Range<usize> = 12..14;
    pub const PAYLOAD: RangeFrom<usize> = 14..;
}

/// Length of the Ethernet II header.
pub const HEADER_LEN: usize = field::PAYLOAD.start;

/// A view of an Ethernet II frame in a buffer.
#[derive(Debug, Clone)]
pub struct EthernetFrame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> EthernetFrame<T> {
    /// Wraps a buffer without checking it; accessors panic if it is shorter than [`HEADER_LEN`].
    pub const fn new_unchecked(buffer: T) -> Self {
        EthernetFrame { buffer }
    }

    /// Wraps a buffer after checking it holds a whole header.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let have = buffer.as_ref().len();
        if have < HEADER_LEN {
            return Err(Error::Truncated { need: HEADER_LEN, have });
        }
        Ok(EthernetFrame { buffer })
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Destination address.
    pub fn dst_addr(&self) -> MacAddr {
        MacAddr(self.buffer.as_ref()[field::DESTINATION].try_into().expect("6-byte range"))
    }

    /// Source address.
    pub fn src_addr(&self) -> MacAddr {
        MacAddr(self.buffer.as_ref()[field::SOURCE].try_into().expect("6-byte range"))
    }

    /// EtherType.
    pub fn ethertype(&self) -> EtherType {
        let b = &self.buffer.as_ref()[field::ETHERTYPE];
        EtherType::from(u16::from_be_bytes([b[0], b[1]]))
    }

    /// Everything after the header.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[field::PAYLOAD]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> EthernetFrame<T> {
    /// Sets the destination address.
    pub fn set_dst_addr(&mut self, a: MacAddr) {
        self.buffer.as_mut()[field::DESTINATION].copy_from_slice(&a.0);
    }

    /// Sets the source address.
    pub fn set_src_addr(&mut self, a: MacAddr) {
        self.buffer.as_mut()[field::SOURCE].copy_from_slice(&a.0);
    }

    /// Sets the EtherType.
    pub fn set_ethertype(&mut self, t: EtherType) {
        self.buffer.as_mut()[field::ETHERTYPE].copy_from_slice(&u16::from(t).to_be_bytes());
    }

    /// Everything after the header, writable.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[field::PAYLOAD]
    }
}

/// The decoded Ethernet header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EthernetRepr {
    /// Source address.
    pub src_addr: MacAddr,
    /// Destination address.
    pub dst_addr: MacAddr,
    /// EtherType.
    pub ethertype: EtherType,
}

impl EthernetRepr {
    /// Reads the header of a checked frame.
    pub fn parse<T: AsRef<[u8]>>(frame: &EthernetFrame<T>) -> Self {
        EthernetRepr { src_addr: frame.src_addr(), dst_addr: frame.dst_addr(), ethertype: frame.ethertype() }
    }

    /// Bytes the header takes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header into a frame at least [`HEADER_LEN`] long.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, frame: &mut EthernetFrame<T>) {
        frame.set_src_addr(self.src_addr);
        frame.set_dst_addr(self.dst_addr);
        frame.set_ethertype(self.ethertype);
    }
}

/// The fuzz target's body: parses arbitrary bytes as a frame and checks that a parsed header
/// emits back to the same bytes. Panics only if that invariant breaks.
#[cfg(any(test, fuzzing))]
pub fn fuzz_frame(data: &[u8]) {
    if let Ok(frame) = EthernetFrame::new_checked(data) {
        let repr = EthernetRepr::parse(&frame);
        let _ = frame.payload();
        let mut out = [0u8; HEADER_LEN];
        repr.emit(&mut EthernetFrame::new_unchecked(&mut out[..]));
        assert_eq!(&out[..], &data[..HEADER_LEN], "header does not round-trip");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A lanbus frame from 02:4c:42:00:00:01 to broadcast with a 2-byte payload.
    static FRAME: [u8; 16] =
        [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02, 0x4c, 0x42, 0x00, 0x00, 0x01, 0x88, 0xb5, 0xab, 0xcd];

    #[test]
    fn deconstruct() {
        let f = EthernetFrame::new_checked(&FRAME[..]).unwrap();
        assert_eq!(f.dst_addr(), MacAddr::BROADCAST);
        assert_eq!(f.src_addr(), MacAddr::local(1));
        assert_eq!(f.ethertype(), EtherType::Lanbus);
        assert_eq!(f.payload(), &[0xab, 0xcd]);
    }

    #[test]
    fn construct() {
        let mut buf = [0u8; 16];
        let mut f = EthernetFrame::new_unchecked(&mut buf[..]);
        let repr = EthernetRepr {
            src_addr: MacAddr::local(1),
            dst_addr: MacAddr::BROADCAST,
            ethertype: EtherType::Lanbus,
        };
        repr.emit(&mut f);
        f.payload_mut().copy_from_slice(&[0xab, 0xcd]);
        assert_eq!(buf, FRAME);
        assert_eq!(EthernetRepr::parse(&EthernetFrame::new_checked(&buf[..]).unwrap()), repr);
    }

    #[test]
    fn truncated() {
        assert_eq!(
            EthernetFrame::new_checked(&FRAME[..13]).unwrap_err(),
            Error::Truncated { need: 14, have: 13 }
        );
    }

    #[test]
    fn mac_text() {
        let m: MacAddr = "02:4C:42:00:00:01".parse().unwrap();
        assert_eq!(m, MacAddr::local(1));
        assert_eq!(m.to_string(), "02:4c:42:00:00:01");
        for bad in ["", "02:4c:42:00:00", "02:4c:42:00:00:01:02", "02:4c:42:00:00:zz", "002:4c:42:00:00:01"] {
            assert!(bad.parse::<MacAddr>().is_err(), "{bad}");
        }
        assert!(MacAddr::BROADCAST.is_multicast() && !MacAddr::local(7).is_multicast());
    }

    #[test]
    fn ethertype_roundtrip() {
        for v in [0x0800u16, 0x0806, 0x86dd, 0x88b5, 0x1234] {
            assert_eq!(u16::from(EtherType::from(v)), v);
        }
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            fuzz_frame(&bytes);
        }
    }
}
