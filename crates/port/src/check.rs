//! Receive-side admission checks shared by the kernel ports (`udp`, `afpacket`).
//!
//! Layer: ports. A port hands the transport only frames that can be lanbus frames at all: an
//! Ethernet II header, EtherType 0x88B5, a payload no shorter than the fixed lanbus header and no
//! longer than the port's MTU. Everything else is counted in `rx_dropped` and never reaches the
//! layer above. The lanbus header's own fields (version, kind, lengths, checksum) are the
//! transport's to check: a port only rejects what cannot be a lanbus frame whatever it says.

use lanbus_wire::ethernet::HEADER_LEN;
use lanbus_wire::EtherType;

/// The shortest Ethernet payload a port delivers: the fixed lanbus header (version, kind, flags,
/// group, channel, sequence, ACK, timestamps, length, checksum, epochs), 40 bytes.
///
/// This mirrors `lanbus_wire::frame::HEADER_LEN` of the transport branch; the two must agree.
pub const MIN_PAYLOAD_BYTES: usize = 40;

/// Why a received frame was not delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// Shorter than an Ethernet header plus [`MIN_PAYLOAD_BYTES`].
    TooShort,
    /// Payload longer than the port's MTU (or cut short by the receive buffer).
    TooLong,
    /// An EtherType other than 0x88B5.
    WrongEtherType,
}

/// Checks a whole received frame (Ethernet header first) against a port MTU.
pub fn check_frame(frame: &[u8], mtu: usize) -> Result<(), Reject> {
    if frame.len() < HEADER_LEN + MIN_PAYLOAD_BYTES {
        return Err(Reject::TooShort);
    }
    if frame.len() - HEADER_LEN > mtu {
        return Err(Reject::TooLong);
    }
    if u16::from_be_bytes([frame[12], frame[13]]) != EtherType::LANBUS_RAW {
        return Err(Reject::WrongEtherType);
    }
    Ok(())
}

/// Checks a frame the caller asks a port to send: a whole Ethernet header, EtherType 0x88B5 and
/// a payload within `mtu`. Ports that carry only lanbus frames (udp) use it; raw ports let any
/// frame of a valid length through.
pub fn check_tx_frame(frame: &[u8], mtu: usize) -> Result<(), Reject> {
    if frame.len() < HEADER_LEN {
        return Err(Reject::TooShort);
    }
    if frame.len() - HEADER_LEN > mtu {
        return Err(Reject::TooLong);
    }
    if u16::from_be_bytes([frame[12], frame[13]]) != EtherType::LANBUS_RAW {
        return Err(Reject::WrongEtherType);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(payload: usize, ethertype: u16) -> Vec<u8> {
        let mut f = vec![0u8; HEADER_LEN + payload];
        f[12..14].copy_from_slice(&ethertype.to_be_bytes());
        f
    }

    #[test]
    fn admits_only_lanbus_frames_within_bounds() {
        assert_eq!(check_frame(&frame(MIN_PAYLOAD_BYTES, 0x88b5), 1500), Ok(()));
        assert_eq!(check_frame(&frame(1500, 0x88b5), 1500), Ok(()));
        assert_eq!(check_frame(&frame(1501, 0x88b5), 1500), Err(Reject::TooLong));
        assert_eq!(check_frame(&frame(MIN_PAYLOAD_BYTES - 1, 0x88b5), 1500), Err(Reject::TooShort));
        assert_eq!(check_frame(&[0u8; 3], 1500), Err(Reject::TooShort));
        assert_eq!(check_frame(&frame(100, 0x0800), 1500), Err(Reject::WrongEtherType));
        assert_eq!(check_tx_frame(&frame(0, 0x88b5), 1500), Ok(()));
        assert_eq!(check_tx_frame(&frame(10, 0x86dd), 1500), Err(Reject::WrongEtherType));
        assert_eq!(check_tx_frame(&[0u8; 13], 1500), Err(Reject::TooShort));
    }
}
