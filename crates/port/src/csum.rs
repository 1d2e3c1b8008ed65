//! Completing checksums the kernel left partial.
//!
//! Layer: ports. A frame that a host sends with checksum offload crosses a veth (or reaches a
//! packet socket before the NIC) with its TCP or UDP checksum field holding only the pseudo-header
//! sum (`CHECKSUM_PARTIAL`; the ring marks it `TP_STATUS_CSUMNOTREADY`). A TCP/IP stack on a raw
//! port must see the finished checksum, as a NIC would have written it: the one's-complement sum
//! of the transport header and data, whose field already carries the pseudo-header part
//! (RFC 1071; RFC 9293 section 3.1; RFC 768).

/// Completes the TCP or UDP checksum of an IPv4 or IPv6 frame (Ethernet header first) whose
/// checksum field holds the pseudo-header sum. Returns whether the frame was such a frame; any
/// other frame, or one whose lengths do not add up, is left as it is.
pub fn complete_partial_checksum(frame: &mut [u8]) -> bool {
    let Some(&[a, b]) = frame.get(12..14) else { return false };
    let (l4, proto, end) = match u16::from_be_bytes([a, b]) {
        0x0800 => {
            let Some(&vihl) = frame.get(14) else { return false };
            let ihl = usize::from(vihl & 0x0f) * 4;
            let Some(&[t0, t1]) = frame.get(16..18) else { return false };
            let total = usize::from(u16::from_be_bytes([t0, t1]));
            let Some(&proto) = frame.get(23) else { return false };
            (14 + ihl, proto, 14 + total)
        }
        0x86DD => {
            let Some(&[p0, p1]) = frame.get(18..20) else { return false };
            let Some(&proto) = frame.get(20) else { return false };
            (54, proto, 54 + usize::from(u16::from_be_bytes([p0, p1])))
        }
        _ => return false,
    };
    let field = match proto {
        6 => 16,
        17 => 6,
        _ => return false,
    };
    if l4 + field + 2 > end || end > frame.len() || l4 < 34 {
        return false;
    }
    let sum = ones_complement_sum(&frame[l4..end]);
    let mut check = !sum;
    if proto == 17 && check == 0 {
        check = 0xffff;
    }
    frame[l4 + field..l4 + field + 2].copy_from_slice(&check.to_be_bytes());
    true
}

/// The folded 16-bit one's-complement sum of `data` (big-endian words, an odd byte padded).
fn ones_complement_sum(data: &[u8]) -> u16 {
    let mut sum: u64 = 0;
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        sum += u64::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u64::from(*last) << 8;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An IPv4 TCP frame (SYN-ACK, 10.9.0.2:5000 -> 10.9.0.1:49152) with its correct checksum.
    fn frame() -> Vec<u8> {
        let mut f = vec![0u8; 14 + 20 + 20];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        f[14] = 0x45;
        f[16..18].copy_from_slice(&40u16.to_be_bytes());
        f[22] = 64;
        f[23] = 6;
        f[26..30].copy_from_slice(&[10, 9, 0, 2]);
        f[30..34].copy_from_slice(&[10, 9, 0, 1]);
        f[34..36].copy_from_slice(&5000u16.to_be_bytes());
        f[36..38].copy_from_slice(&49152u16.to_be_bytes());
        f[38..42].copy_from_slice(&0x1234_5678u32.to_be_bytes());
        f[46] = 0x50;
        f[47] = 0x12;
        f[48..50].copy_from_slice(&64240u16.to_be_bytes());
        f
    }

    fn pseudo_sum(f: &[u8]) -> u16 {
        let mut p = Vec::new();
        p.extend_from_slice(&f[26..34]);
        p.extend_from_slice(&[0, 6, 0, 20]);
        ones_complement_sum(&p)
    }

    #[test]
    fn completes_what_the_kernel_left_partial() {
        let mut f = frame();
        // What a full software checksum gives: over pseudo-header and segment with a zero field.
        let mut whole = f[26..34].to_vec();
        whole.extend_from_slice(&[0, 6, 0, 20]);
        whole.extend_from_slice(&f[34..54]);
        let expected = !ones_complement_sum(&whole);
        // What the sender's kernel leaves with offload: the pseudo-header sum in the field.
        let partial = pseudo_sum(&f);
        f[50..52].copy_from_slice(&partial.to_be_bytes());
        assert!(complete_partial_checksum(&mut f));
        assert_eq!(u16::from_be_bytes([f[50], f[51]]), expected);
    }

    #[test]
    fn leaves_other_frames_alone() {
        let mut arp = vec![0u8; 42];
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        assert!(!complete_partial_checksum(&mut arp));
        let mut short = frame();
        short.truncate(40);
        assert!(!complete_partial_checksum(&mut short));
        let mut icmp = frame();
        icmp[23] = 1;
        assert!(!complete_partial_checksum(&mut icmp));
        for n in 0..60 {
            let mut f = frame();
            f.truncate(n);
            let _ = complete_partial_checksum(&mut f);
        }
    }
}
