//! Fuzz entry for the server's frame input: whatever arrives on the wire reaches smoltcp only
//! through the same path as in the server (the port's checksum completion, then the interface),
//! and nothing in it may panic.

use std::collections::VecDeque;

use smoltcp::iface::{Config, Interface, SocketSet};
use smoltcp::phy::{self, DeviceCapabilities, Medium};
use smoltcp::socket::{tcp, udp};
use smoltcp::time::Instant;
use smoltcp::wire::{EthernetAddress, HardwareAddress, IpAddress, IpCidr};

struct Frames {
    rx: VecDeque<Vec<u8>>,
    sent: usize,
}

struct Rx(Vec<u8>);
struct Tx<'a>(&'a mut usize);

impl phy::RxToken for Rx {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(&self.0)
    }
}

impl phy::TxToken for Tx<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        *self.0 += 1;
        f(&mut vec![0; len])
    }
}

impl phy::Device for Frames {
    type RxToken<'a> = Rx;
    type TxToken<'a> = Tx<'a>;
    fn receive(&mut self, _now: Instant) -> Option<(Rx, Tx<'_>)> {
        let frame = self.rx.pop_front()?;
        Some((Rx(frame), Tx(&mut self.sent)))
    }
    fn transmit(&mut self, _now: Instant) -> Option<Tx<'_>> {
        Some(Tx(&mut self.sent))
    }
    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = 1514;
        caps
    }
}

/// Splits `data` into frames (each a 2-byte little-endian length, then that many bytes), completes
/// their checksums as the port does, and feeds them to an interface at 10.0.0.1 with a TCP
/// listener on port 80 and a UDP socket on port 53, polling between frames on a logical clock.
pub fn fuzz_frames(data: &[u8]) {
    let mut frames = Frames { rx: VecDeque::new(), sent: 0 };
    let mut at = 0;
    while at + 2 <= data.len() {
        let len = usize::from(u16::from_le_bytes([data[at], data[at + 1]]));
        at += 2;
        let end = (at + len).min(data.len());
        let mut frame = data[at..end].to_vec();
        lanbus_port::csum::complete_partial_checksum(&mut frame);
        frames.rx.push_back(frame);
        at = end;
    }
    let mac = EthernetAddress([2, 0, 0, 0, 0, 1]);
    let mut iface = Interface::new(Config::new(HardwareAddress::Ethernet(mac)), &mut frames, Instant::ZERO);
    iface.update_ip_addrs(|a| {
        let _ = a.push(IpCidr::new(IpAddress::v4(10, 0, 0, 1), 24));
        let _ = a.push(IpCidr::new(IpAddress::v6(0xfd00, 0, 0, 0, 0, 0, 0, 1), 64));
    });
    let mut sockets = SocketSet::new(Vec::new());
    let mut t =
        tcp::Socket::new(tcp::SocketBuffer::new(vec![0; 4096]), tcp::SocketBuffer::new(vec![0; 4096]));
    let _ = t.listen(80);
    let th = sockets.add(t);
    let mut u = udp::Socket::new(
        udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 8], vec![0; 4096]),
        udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 8], vec![0; 4096]),
    );
    let _ = u.bind(53);
    let uh = sockets.add(u);
    let mut now = Instant::ZERO;
    while !frames.rx.is_empty() {
        iface.poll(now, &mut frames, &mut sockets);
        let s = sockets.get_mut::<tcp::Socket>(th);
        while s.can_recv() {
            if s.recv(|b| (b.len(), ())).is_err() {
                break;
            }
        }
        let u = sockets.get_mut::<udp::Socket>(uh);
        while u.recv().is_ok() {}
        now += smoltcp::time::Duration::from_millis(7);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A SYN from 10.0.0.2:40000 to 10.0.0.1:80, its checksum left partial as Linux leaves it.
    fn syn() -> Vec<u8> {
        let mut f = vec![0u8; 54];
        f[..6].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
        f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 2]);
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        f[14] = 0x45;
        f[16..18].copy_from_slice(&40u16.to_be_bytes());
        f[22] = 64;
        f[23] = 6;
        f[26..30].copy_from_slice(&[10, 0, 0, 2]);
        f[30..34].copy_from_slice(&[10, 0, 0, 1]);
        let mut sum: u32 = 0;
        for w in f[14..34].chunks(2) {
            sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
        let ip = !((sum & 0xffff) + (sum >> 16)) as u16;
        f[24..26].copy_from_slice(&ip.to_be_bytes());
        f[34..36].copy_from_slice(&40000u16.to_be_bytes());
        f[36..38].copy_from_slice(&80u16.to_be_bytes());
        f[38..42].copy_from_slice(&1u32.to_be_bytes());
        f[46] = 0x50;
        f[47] = 0x02;
        f[48..50].copy_from_slice(&8192u16.to_be_bytes());
        // Pseudo-header sum: addresses, protocol, TCP length.
        let mut p: u32 = 6 + 20;
        for w in f[26..34].chunks(2) {
            p += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
        let p = ((p & 0xffff) + (p >> 16)) as u16;
        f[50..52].copy_from_slice(&p.to_be_bytes());
        f
    }

    fn framed(frames: &[Vec<u8>]) -> Vec<u8> {
        let mut out = Vec::new();
        for f in frames {
            out.extend_from_slice(&(f.len() as u16).to_le_bytes());
            out.extend_from_slice(f);
        }
        out
    }

    #[test]
    fn a_syn_with_a_partial_checksum_is_answered() {
        let mut frames = Frames { rx: VecDeque::new(), sent: 0 };
        let mut f = syn();
        assert!(lanbus_port::csum::complete_partial_checksum(&mut f));
        frames.rx.push_back(f);
        let mut iface = Interface::new(
            Config::new(HardwareAddress::Ethernet(EthernetAddress([2, 0, 0, 0, 0, 1]))),
            &mut frames,
            Instant::ZERO,
        );
        iface.update_ip_addrs(|a| {
            let _ = a.push(IpCidr::new(IpAddress::v4(10, 0, 0, 1), 24));
        });
        let mut sockets = SocketSet::new(Vec::new());
        let mut t =
            tcp::Socket::new(tcp::SocketBuffer::new(vec![0; 4096]), tcp::SocketBuffer::new(vec![0; 4096]));
        t.listen(80).unwrap();
        let th = sockets.add(t);
        iface.poll(Instant::ZERO, &mut frames, &mut sockets);
        assert_eq!(sockets.get::<tcp::Socket>(th).state(), tcp::State::SynReceived);
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..600)) {
            fuzz_frames(&data);
        }

        #[test]
        fn mutated_segments_never_panic(flips in proptest::collection::vec((14usize..54, any::<u8>()), 1..6),
                                        cut in 0usize..60) {
            let mut f = syn();
            for (at, b) in flips {
                f[at] ^= b;
            }
            let mut g = syn();
            g.truncate(cut);
            fuzz_frames(&framed(&[syn(), f, g]));
        }
    }
}
