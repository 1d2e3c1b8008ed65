//! The remote NIC's floor: the least a user-space path from a host's TAP to an interface in
//! another machine must do, with nothing of PCIe in it.
//!
//! A relay thread on each side of the fabric reads frames from its TAP (with their
//! `virtio_net_hdr`, so 64 KiB TCP segments and partial checksums pass through as they do through
//! the remote NIC), sends each in as few port frames as the MTU allows, and writes what comes from
//! the port to its TAP. No transport (nothing is retransmitted: TCP recovers a frame the port
//! drops), no virtqueues, no DMA: one read from the TAP, the port's own send and receive, one
//! write to the TAP, which every design of such a path has. Run through it, iperf3 measures what
//! the two cores give that path; the remote NIC's rows compare with it (`raw-tap:PORT`).
//!
//! A tunnel frame is an Ethernet header (type [`EtherType::LANBUS_RAW`]) and pieces of TAP frames,
//! as many as fit (small frames share a port frame, as the remote NIC's small packets share its
//! fabric frames), each an 8-byte header (the TAP frame's number, its length, the piece's index and
//! the count of pieces) and the piece's bytes. The pieces of a frame leave last first, so the
//! receiver holds only the short tail and writes the large head straight from the port's receive
//! ring, in one `writev`.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lanbus_port::Port;
use lanbus_vnet::device::Offloads;
use lanbus_vnet::tap::Tap;
use lanbus_wire::ethernet::{EtherType, HEADER_LEN};
use lanbus_wire::MacAddr;

/// Bytes of the tunnel header after the Ethernet header.
const TUNNEL_HDR: usize = 8;
/// TAP frames a relay reads before it sends them.
const BATCH: usize = 16;
/// How long a relay with nothing to move spins before it sleeps on its two descriptors.
const SPIN: Duration = Duration::from_micros(50);

/// The tunnel header of one piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    /// The TAP frame's number (wrapping).
    frame: u16,
    /// This piece's index, 0 first.
    index: u8,
    /// How many pieces the frame has.
    count: u8,
    /// The whole TAP frame's length.
    len: u32,
}

impl Piece {
    fn emit(&self, out: &mut [u8]) {
        out[0..2].copy_from_slice(&self.frame.to_be_bytes());
        out[2] = self.index;
        out[3] = self.count;
        out[4..8].copy_from_slice(&self.len.to_be_bytes());
    }

    /// The header at the start of `b`, or `None` for anything that is not a piece.
    fn parse(b: &[u8]) -> Option<Piece> {
        let h = b.get(..TUNNEL_HDR)?;
        let p = Piece {
            frame: u16::from_be_bytes([h[0], h[1]]),
            index: h[2],
            count: h[3],
            len: u32::from_be_bytes([h[4], h[5], h[6], h[7]]),
        };
        (p.count > 0 && p.index < p.count && p.len as usize <= lanbus_vnet::MAX_BUFFER).then_some(p)
    }
}

/// Where the bytes of piece `index` of a `len`-byte frame lie, `per` bytes a piece.
fn piece_range(len: usize, per: usize, index: usize) -> std::ops::Range<usize> {
    let start = index * per;
    start..(start + per).min(len)
}

/// What a relay counted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RelayCounters {
    /// TAP frames sent into the port.
    pub sent: u64,
    /// TAP frames written out of the port.
    pub delivered: u64,
    /// Pieces dropped: malformed, out of place, or of a frame whose pieces did not all come.
    pub dropped: u64,
    /// Frames of other kinds the port received (the link's own neighbour discovery), ignored.
    pub foreign: u64,
}

/// A TAP frame's pieces arriving from the port: all but the one that completes it are held.
struct Assembly {
    current: Option<Piece>,
    held: Vec<Vec<u8>>,
    have: usize,
}

impl Assembly {
    fn new() -> Assembly {
        Assembly { current: None, held: Vec::new(), have: 0 }
    }

    /// Takes one piece's header and bytes; when they complete a frame, `write` gets the frame's
    /// pieces in order (the last-arrived one straight from `bytes`). Returns the pieces dropped.
    fn take(&mut self, p: Piece, bytes: &[u8], per: usize, write: &mut dyn FnMut(&[&[u8]])) -> u64 {
        let count = usize::from(p.count);
        let index = usize::from(p.index);
        let whole = (p.len as usize).div_ceil(per).max(1) == count;
        if !whole || piece_range(p.len as usize, per, index).len() != bytes.len() {
            return 1;
        }
        if count == 1 {
            write(&[bytes]);
            return 0;
        }
        let mut dropped = 0;
        let same = self.current.is_some_and(|c| (c.frame, c.count, c.len) == (p.frame, p.count, p.len));
        if !same {
            // An earlier frame that never completed: its pieces are lost.
            dropped += self.have as u64;
            self.current = Some(p);
            self.have = 0;
            self.held.resize_with(count, Vec::new);
            self.held.iter_mut().for_each(Vec::clear);
        }
        if !self.held[index].is_empty() {
            return dropped + 1;
        }
        if self.have + 1 < count {
            self.held[index].extend_from_slice(bytes);
            self.have += 1;
            return dropped;
        }
        let parts: Vec<&[u8]> =
            (0..count).map(|i| if i == index { bytes } else { self.held[i].as_slice() }).collect();
        write(&parts);
        self.current = None;
        self.have = 0;
        dropped
    }
}

/// One side of the tunnel: its TAP, its port and the other side's MAC.
struct Relay {
    tap: Tap,
    port: Box<dyn Port>,
    peer: MacAddr,
    counters: RelayCounters,
}

impl Relay {
    /// Moves frames both ways until `stop`.
    fn run(mut self, stop: &AtomicBool) -> anyhow::Result<RelayCounters> {
        let mtu = self.port.mtu();
        if mtu <= TUNNEL_HDR + 64 {
            anyhow::bail!("an MTU of {mtu} is too small for the tunnel");
        }
        let per = mtu - TUNNEL_HDR;
        let mut frames: Vec<Vec<u8>> = (0..BATCH).map(|_| vec![0u8; lanbus_vnet::MAX_BUFFER]).collect();
        let mut lens = Vec::with_capacity(BATCH);
        let mut assembly = Assembly::new();
        let mut number = 0u16;
        let mut idle = Instant::now();
        // Relaxed: only the flag itself is published.
        while !stop.load(Ordering::Relaxed) {
            lens.clear();
            while lens.len() < BATCH {
                let Some(n) = self.tap.read_now(&mut frames[lens.len()])? else { break };
                lens.push(n);
            }
            let read = lens.len();
            if read > 0 {
                self.send(stop, &frames, &lens, &mut number, per)?;
            }
            let tap = &self.tap;
            let counters = &mut self.counters;
            let got = self.port.rx_burst(64, &mut |f| {
                receive(f, per, &mut assembly, counters, &mut |parts| {
                    // A TAP that cannot take the frame now drops it, as a full queue would.
                    writev(tap.fd(), parts).is_ok()
                })
            })?;
            if read > 0 || got > 0 {
                idle = Instant::now();
            } else if idle.elapsed() > SPIN {
                sleep_on(&[self.tap.fd(), self.port.readiness_fd().unwrap_or(-1)], Duration::from_millis(5))?;
            }
        }
        Ok(self.counters)
    }

    /// Sends the TAP frames `frames[i][..lens[i]]`, each in pieces of up to `per` bytes, the last
    /// piece first, as many pieces in a port frame as fit. A port whose queue stays full is
    /// waited for until `stop`.
    fn send(
        &mut self,
        stop: &AtomicBool,
        frames: &[Vec<u8>],
        lens: &[usize],
        number: &mut u16,
        per: usize,
    ) -> anyhow::Result<()> {
        // (frame, piece index, count) in the order they leave.
        let mut pieces = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            let count = len.div_ceil(per).max(1);
            if count > usize::from(u8::MAX) {
                self.counters.dropped += 1;
                continue;
            }
            pieces.extend((0..count).rev().map(|p| (i, p, count)));
        }
        let first = *number;
        *number = number.wrapping_add(lens.len() as u16);
        let (own, peer) = (self.port.mac(), self.peer);
        let mut next = 0;
        while next < pieces.len() {
            let sent = self.port.tx_burst(pieces.len() - next, &mut |out| {
                if next == pieces.len() {
                    return None;
                }
                out[0..6].copy_from_slice(&peer.0);
                out[6..12].copy_from_slice(&own.0);
                out[12..14].copy_from_slice(&EtherType::LANBUS_RAW.to_be_bytes());
                let mut at = HEADER_LEN;
                let room = HEADER_LEN + per + TUNNEL_HDR;
                while let Some(&(f, index, count)) = pieces.get(next) {
                    let len = lens[f];
                    let bytes = &frames[f][piece_range(len, per, index)];
                    if at + TUNNEL_HDR + bytes.len() > room {
                        break;
                    }
                    let p = Piece {
                        frame: first.wrapping_add(f as u16),
                        index: index as u8,
                        count: count as u8,
                        len: len as u32,
                    };
                    p.emit(&mut out[at..]);
                    out[at + TUNNEL_HDR..at + TUNNEL_HDR + bytes.len()].copy_from_slice(bytes);
                    at += TUNNEL_HDR + bytes.len();
                    next += 1;
                }
                Some(at)
            })?;
            if sent == 0 {
                if stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
                std::thread::yield_now();
            }
        }
        self.counters.sent += lens.len() as u64;
        Ok(())
    }
}

/// Takes one frame from the port: its pieces go to `assembly`, and `write` gets each TAP frame
/// they complete (in pieces, in order) and says whether the TAP took it.
fn receive(
    f: &[u8],
    per: usize,
    assembly: &mut Assembly,
    counters: &mut RelayCounters,
    write: &mut dyn FnMut(&[&[u8]]) -> bool,
) {
    if f.len() < HEADER_LEN || u16::from_be_bytes([f[12], f[13]]) != EtherType::LANBUS_RAW {
        counters.foreign += 1;
        return;
    }
    let mut rest = &f[HEADER_LEN..];
    while !rest.is_empty() {
        let Some(p) = Piece::parse(rest) else {
            counters.dropped += 1;
            return;
        };
        let n = piece_range(p.len as usize, per, usize::from(p.index)).len();
        let Some(bytes) = rest.get(TUNNEL_HDR..TUNNEL_HDR + n) else {
            counters.dropped += 1;
            return;
        };
        let mut delivered = 0;
        counters.dropped += assembly.take(p, bytes, per, &mut |parts| {
            if write(parts) {
                delivered += 1;
            }
        });
        counters.delivered += delivered;
        rest = &rest[TUNNEL_HDR + n..];
    }
}

/// Fuzzing entry: `data` is a piece size (two bytes) and then frames, each a two-byte length and
/// its bytes, received one after the other; every TAP frame that comes out must be as long as
/// its pieces said.
pub fn fuzz_receive(data: &[u8]) {
    let Some((size, mut rest)) = data.split_first_chunk::<2>() else { return };
    let per = usize::from(u16::from_be_bytes(*size)).max(1);
    let mut assembly = Assembly::new();
    let mut counters = RelayCounters::default();
    while let Some((len, tail)) = rest.split_first_chunk::<2>() {
        let n = usize::from(u16::from_be_bytes(*len)).min(tail.len());
        let (frame, tail) = tail.split_at(n);
        receive(frame, per, &mut assembly, &mut counters, &mut |parts| {
            assert!(parts.iter().map(|p| p.len()).sum::<usize>() <= lanbus_vnet::MAX_BUFFER);
            true
        });
        rest = tail;
    }
}

/// Writes `parts` to `fd` as one frame.
fn writev(fd: RawFd, parts: &[&[u8]]) -> io::Result<()> {
    let iov: Vec<libc::iovec> = parts
        .iter()
        .map(|p| libc::iovec { iov_base: p.as_ptr() as *mut libc::c_void, iov_len: p.len() })
        .collect();
    // SAFETY: every iovec points into a slice that lives across the call; the kernel only reads.
    let n = unsafe { libc::writev(fd, iov.as_ptr(), iov.len() as libc::c_int) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sleeps until one of `fds` (negative ones are skipped) is readable or `timeout` passes.
fn sleep_on(fds: &[RawFd], timeout: Duration) -> io::Result<()> {
    let mut p: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    // SAFETY: a valid array of pollfds of the given length.
    let n =
        unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, timeout.as_millis() as libc::c_int) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

/// A running tunnel: two relays. Stops them when dropped.
pub struct Tunnel {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<anyhow::Result<RelayCounters>>>,
}

impl Tunnel {
    /// Joins the TAP `host_tap` (opened in `host`'s namespace) and the TAP `box_tap` (in `io`'s)
    /// through ports `host_port` and `io_port`, both TAPs with segmentation offload and up.
    pub fn start(
        host: &lanbus_port::netns::Netns,
        host_tap: &str,
        host_port: Box<dyn Port>,
        io: &lanbus_port::netns::Netns,
        box_tap: &str,
        io_port: Box<dyn Port>,
    ) -> anyhow::Result<Tunnel> {
        let open = |ns: &lanbus_port::netns::Netns, name: &str| -> anyhow::Result<Tap> {
            let name = name.to_string();
            let tap = ns.run(move || -> io::Result<Tap> {
                let tap = Tap::open(&name)?;
                tap.set_offloads(Offloads { csum: true, tso4: true, tso6: true, ecn: true })?;
                tap.configure(None, None, true)?;
                Ok(tap)
            })??;
            Ok(tap)
        };
        let (a, b) = (open(host, host_tap)?, open(io, box_tap)?);
        let (mac_a, mac_b) = (host_port.mac(), io_port.mac());
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for (name, relay) in [
            ("tunnel-host", Relay { tap: a, port: host_port, peer: mac_b, counters: Default::default() }),
            ("tunnel-box", Relay { tap: b, port: io_port, peer: mac_a, counters: Default::default() }),
        ] {
            let s = stop.clone();
            threads.push(std::thread::Builder::new().name(name.into()).spawn(move || relay.run(&s))?);
        }
        Ok(Tunnel { stop, threads })
    }

    /// Stops both relays: what each counted, or why one stopped early.
    pub fn stop(mut self) -> anyhow::Result<[RelayCounters; 2]> {
        self.stop.store(true, Ordering::Relaxed);
        let mut out = [RelayCounters::default(); 2];
        for (o, t) in out.iter_mut().zip(std::mem::take(&mut self.threads)) {
            *o = t.join().map_err(|_| anyhow::anyhow!("a tunnel relay panicked"))??;
        }
        Ok(out)
    }
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Cuts `frame` into pieces of `per` bytes as the sender does, last first.
    fn cut(frame: &[u8], per: usize, number: u16) -> Vec<(Piece, Vec<u8>)> {
        let count = frame.len().div_ceil(per).max(1);
        (0..count)
            .rev()
            .map(|i| {
                let p = Piece { frame: number, index: i as u8, count: count as u8, len: frame.len() as u32 };
                (p, frame[piece_range(frame.len(), per, i)].to_vec())
            })
            .collect()
    }

    fn deliver(a: &mut Assembly, pieces: &[(Piece, Vec<u8>)], per: usize) -> (Vec<Vec<u8>>, u64) {
        let mut out = Vec::new();
        let mut dropped = 0;
        for (p, b) in pieces {
            dropped += a.take(*p, b, per, &mut |parts| out.push(parts.concat()));
        }
        (out, dropped)
    }

    #[test]
    fn a_frame_larger_than_a_piece_comes_back_whole() {
        let frame: Vec<u8> = (0..65_226u32).map(|i| i as u8).collect();
        let pieces = cut(&frame, 64_992, 7);
        assert_eq!(pieces.len(), 2);
        assert_eq!(pieces[0].1.len(), 65_226 - 64_992, "the short tail leaves first");
        let (out, dropped) = deliver(&mut Assembly::new(), &pieces, 64_992);
        assert_eq!((out, dropped), (vec![frame], 0));
    }

    #[test]
    fn a_frame_missing_a_piece_is_dropped_and_the_next_one_still_comes() {
        let per = 100;
        let first: Vec<u8> = vec![1; 250];
        let second: Vec<u8> = vec![2; 180];
        let mut pieces = cut(&first, per, 1);
        pieces.remove(1);
        pieces.extend(cut(&second, per, 2));
        let (out, dropped) = deliver(&mut Assembly::new(), &pieces, per);
        assert_eq!(out, vec![second]);
        assert_eq!(dropped, 2, "the two pieces of the first frame that came");
    }

    #[test]
    fn headers_round_trip_and_nonsense_is_refused() {
        let p = Piece { frame: 0xBEEF, index: 1, count: 2, len: 65_226 };
        let mut b = [0u8; TUNNEL_HDR];
        p.emit(&mut b);
        assert_eq!(Piece::parse(&b), Some(p));
        assert_eq!(Piece::parse(&b[..7]), None);
        let bad = Piece { index: 2, ..p };
        bad.emit(&mut b);
        assert_eq!(Piece::parse(&b), None);
    }

    proptest! {
        #[test]
        fn any_bytes_from_the_port_are_taken_or_counted(data in proptest::collection::vec(any::<u8>(), 0..4000)) {
            fuzz_receive(&data);
        }

        #[test]
        fn any_piece_sequence_delivers_only_whole_frames(
            raw in proptest::collection::vec((any::<u16>(), any::<u8>(), any::<u8>(), 0u32..2000, 0usize..300), 0..40),
        ) {
            let per = 128;
            let mut a = Assembly::new();
            for (frame, index, count, len, n) in raw {
                let mut h = [0u8; TUNNEL_HDR];
                Piece { frame, index, count, len }.emit(&mut h);
                let Some(p) = Piece::parse(&h) else { continue };
                let bytes = vec![index; n];
                a.take(p, &bytes, per, &mut |parts| {
                    let total: usize = parts.iter().map(|x| x.len()).sum();
                    assert_eq!(total, p.len as usize);
                });
            }
        }
    }
}
