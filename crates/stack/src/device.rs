//! smoltcp's `Device` on a lanbus port.
//!
//! Layer: stack (the link). Received frames are taken from the port a burst at a time and
//! queued; frames smoltcp transmits are queued and leave in bursts when the server flushes (after
//! each poll), so a window of segments costs one system call, not one per segment. Buffers are
//! recycled, so the steady state does not allocate.
//!
//! Invariants: a frame is handed to smoltcp only if it is a whole Ethernet frame within the MTU
//! (the port checks); smoltcp parses everything above that with its checked views and drops what
//! does not parse. Frames the port would not take (it is full) wait in the queue, in order.

use std::collections::VecDeque;

use lanbus_port::Port;
use smoltcp::phy::{self, DeviceCapabilities, Medium};
use smoltcp::time::Instant;

/// Frames pulled from the port per burst.
const RX_BURST: usize = 64;
/// Transmit frames queued before the device flushes on its own.
const TX_FLUSH: usize = 64;

/// Counters of the link.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LinkCounters {
    /// Frames handed to the stack.
    pub rx_frames: u64,
    /// Frames the stack transmitted.
    pub tx_frames: u64,
    /// Port errors (a failed burst).
    pub port_errors: u64,
    /// Runs of segments sent as one segmentation-offloaded frame.
    pub offloaded: u64,
}

/// The device: a port plus receive and transmit queues.
pub struct PortDevice {
    rx: VecDeque<Vec<u8>>,
    rx_spare: Vec<Vec<u8>>,
    tx: TxSide,
    mtu: usize,
    rx_frames: u64,
    /// Frames smoltcp may still take in this poll: bounded so that its egress pass (ACKs, window
    /// updates) runs between batches and the sender stays ACK-clocked.
    rx_budget: usize,
    /// Listening TCP ports and the room left in each one's backlog: a connection request (SYN)
    /// past it is dropped, as Linux drops it, so that the peer retries rather than being
    /// refused.
    pub backlog_room: std::collections::HashMap<u16, usize>,
    /// Connection requests dropped so.
    pub syns_dropped: u64,
}

/// The destination port of `frame` (Ethernet) if it is a TCP connection request (SYN without
/// ACK).
pub fn syn_port(frame: &[u8]) -> Option<u16> {
    let ip = frame.get(14..)?;
    let tcp = match u16::from_be_bytes([frame[12], frame[13]]) {
        0x0800 if ip.len() >= 20 && ip[9] == 6 => ip.get(usize::from(ip[0] & 0x0f) * 4..)?,
        0x86dd if ip.len() >= 40 && ip[6] == 6 => &ip[40..],
        _ => return None,
    };
    let flags = *tcp.get(13)?;
    (flags & 0x02 != 0 && flags & 0x10 == 0).then(|| u16::from_be_bytes([tcp[2], tcp[3]]))
}

/// What transmitting borrows: the port, the queue and its spare buffers (apart from the receive
/// queue, so that smoltcp can hold a receive and a transmit token at once).
struct TxSide {
    port: Box<dyn Port>,
    queue: VecDeque<Vec<u8>>,
    spare: Vec<Vec<u8>>,
    frames: u64,
    port_errors: u64,
    /// Whether runs of segments go to the port as offloaded frames (until it says it cannot).
    gso: bool,
    /// Where a run is merged.
    merged: Vec<u8>,
    /// Offloaded frames sent.
    offloaded: u64,
}

/// What segmentation offload needs to know of a queued IPv4 TCP frame.
struct Segment {
    /// Ethernet, IP and TCP header bytes.
    header: usize,
    seq: u32,
    flags: u8,
    payload: usize,
}

const TCP_ACK: u8 = 0x10;
const TCP_PSH: u8 = 0x08;

/// Parses `frame` as an IPv4 TCP segment with data that segmentation offload may carry: no IP
/// options or fragments, only ACK (and PSH) set.
fn segment(frame: &[u8]) -> Option<Segment> {
    if frame.len() < 54 || frame[12..14] != [0x08, 0x00] || frame[14] != 0x45 || frame[23] != 6 {
        return None;
    }
    // Fragment offset and MF must be zero.
    if u16::from_be_bytes([frame[20], frame[21]]) & 0x3fff != 0 {
        return None;
    }
    let total = usize::from(u16::from_be_bytes([frame[16], frame[17]]));
    let tcp_len = usize::from(frame[46] >> 4) * 4;
    let header = 34 + tcp_len;
    let flags = frame[47];
    if total + 14 != frame.len() || tcp_len < 20 || header >= frame.len() || flags & !(TCP_ACK | TCP_PSH) != 0
    {
        return None;
    }
    let seq = u32::from_be_bytes(frame[38..42].try_into().ok()?);
    Some(Segment { header, seq, flags, payload: frame.len() - header })
}

/// Whether `next` continues `prev` in one flow with the same headers but for the sequence number
/// (and the IP id and checksums, which segmentation rewrites).
fn continues(prev: &[u8], p: &Segment, next: &[u8], n: &Segment) -> bool {
    p.header == n.header
        && p.flags == TCP_ACK
        && n.seq == p.seq.wrapping_add(p.payload as u32)
        // Ethernet header and IP version/TOS; then flags, fragment, TTL, protocol; addresses
        // and ports; ACK number and data offset; window; urgent pointer and options. Not: the
        // lengths, the IP id, the sequence number, the TCP flags (PSH may differ) or checksums.
        && prev[..16] == next[..16]
        && prev[20..24] == next[20..24]
        && prev[26..38] == next[26..38]
        && prev[42..47] == next[42..47]
        && prev[48..50] == next[48..50]
        && prev[52..p.header] == next[52..n.header]
}

impl TxSide {
    /// Sends every queued frame the port takes; returns whether frames still wait. Runs of
    /// back-to-back segments of one TCP flow go to the port as one segmentation-offloaded frame
    /// where it can take one.
    fn flush(&mut self) -> bool {
        while !self.queue.is_empty() {
            if self.gso {
                let run = self.offload_run();
                if run >= 2 {
                    match self.send_offloaded(run) {
                        Ok(true) => continue,
                        Ok(false) => self.gso = false,
                        Err(e) => {
                            // A full queue (or any refusal) of the offloaded frame: the run goes
                            // the ordinary way, which waits for room itself.
                            self.port_errors += 1;
                            tracing::debug!("port transmit: {e}");
                            if !self.flush_plain_n(run) {
                                return true;
                            }
                            continue;
                        }
                    }
                }
            }
            let mut plain = self.queue.len();
            if self.gso {
                plain = (0..self.queue.len()).find(|&i| self.offload_run_at(i) >= 2).unwrap_or(plain).max(1);
            }
            if !self.flush_plain_n(plain) {
                return true;
            }
        }
        false
    }

    /// How many frames at the head of the queue form one offloadable run (within 64 KiB).
    fn offload_run(&self) -> usize {
        self.offload_run_at(0)
    }

    /// How many frames from `start` form one offloadable run.
    fn offload_run_at(&self, start: usize) -> usize {
        let Some(first) = self.queue.get(start) else { return 0 };
        let Some(mut prev) = segment(first) else { return 0 };
        let mss = prev.payload;
        let mut total = first.len();
        let mut run = 1;
        let mut prev_frame = first;
        for next in self.queue.iter().skip(start + 1) {
            let Some(n) = segment(next) else { break };
            if prev.payload != mss || n.payload > mss || !continues(prev_frame, &prev, next, &n) {
                break;
            }
            if total + n.payload > 65535 + 14 {
                break;
            }
            total += n.payload;
            run += 1;
            prev = n;
            prev_frame = next;
        }
        run
    }

    /// Sends the first `run` queued frames as one offloaded segment; `Ok(false)` when the port
    /// cannot (nothing sent).
    fn send_offloaded(&mut self, run: usize) -> lanbus_port::Result<bool> {
        let first = &self.queue[0];
        let seg = segment(first).expect("checked by offload_run");
        let mut merged = std::mem::take(&mut self.merged);
        merged.clear();
        merged.extend_from_slice(first);
        let mut flags = seg.flags;
        for f in self.queue.iter().take(run).skip(1) {
            merged.extend_from_slice(&f[seg.header..]);
            flags |= f[47];
        }
        let total = (merged.len() - 14) as u16;
        merged[16..18].copy_from_slice(&total.to_be_bytes());
        merged[47] = flags;
        merged[24..26].copy_from_slice(&[0, 0]);
        let ip_sum = !ones_complement(&merged[14..34]);
        merged[24..26].copy_from_slice(&ip_sum.to_be_bytes());
        // The TCP checksum field holds the pseudo-header sum; the kernel or device finishes it.
        let tcp_len = (merged.len() - 34) as u32;
        let mut pseudo = u32::from(ones_complement(&merged[26..34])) + 6 + tcp_len;
        while pseudo > 0xffff {
            pseudo = (pseudo & 0xffff) + (pseudo >> 16);
        }
        merged[50..52].copy_from_slice(&(pseudo as u16).to_be_bytes());
        let gso = lanbus_port::Gso {
            segment_bytes: seg.payload as u16,
            csum_start: 34,
            csum_offset: 16,
            header_bytes: seg.header as u16,
            ipv6: false,
        };
        let sent = self.port.tx_gso(&merged, gso);
        self.merged = merged;
        if sent? {
            for _ in 0..run {
                if let Some(f) = self.queue.pop_front() {
                    self.spare.push(f);
                }
            }
            self.offloaded += 1;
            return Ok(true);
        }
        Ok(false)
    }

    /// Sends up to `plain` queued frames through the port's ordinary path; returns false when
    /// the port took nothing.
    fn flush_plain_n(&mut self, plain: usize) -> bool {
        {
            let (queue, spare) = (&mut self.queue, &mut self.spare);
            let sent = self.port.tx_burst(plain, &mut |buf| {
                let frame = queue.pop_front()?;
                let len = frame.len().min(buf.len());
                buf[..len].copy_from_slice(&frame[..len]);
                spare.push(frame);
                Some(len)
            });
            match sent {
                Ok(0) => false,
                Ok(_) => true,
                Err(e) => {
                    self.port_errors += 1;
                    tracing::debug!("port transmit: {e}");
                    false
                }
            }
        }
    }
}

/// The folded one's-complement sum of big-endian 16-bit words.
fn ones_complement(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for w in data.chunks(2) {
        sum += u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

impl PortDevice {
    /// Wraps `port`.
    pub fn new(port: Box<dyn Port>) -> PortDevice {
        let mtu = port.mtu();
        PortDevice {
            rx: VecDeque::new(),
            rx_spare: Vec::new(),
            tx: TxSide {
                port,
                queue: VecDeque::new(),
                spare: Vec::new(),
                frames: 0,
                port_errors: 0,
                gso: true,
                merged: Vec::new(),
                offloaded: 0,
            },
            mtu,
            rx_frames: 0,
            rx_budget: RX_BURST,
            backlog_room: std::collections::HashMap::new(),
            syns_dropped: 0,
        }
    }

    /// The port underneath.
    pub fn port(&self) -> &dyn Port {
        &*self.tx.port
    }

    /// Mutable access to the port (waiting on it).
    pub fn port_mut(&mut self) -> &mut dyn Port {
        &mut *self.tx.port
    }

    /// Counters.
    pub fn counters(&self) -> LinkCounters {
        LinkCounters {
            rx_frames: self.rx_frames,
            tx_frames: self.tx.frames,
            port_errors: self.tx.port_errors,
            offloaded: self.tx.offloaded,
        }
    }

    /// Pulls a burst from the port if nothing is queued; returns whether frames are waiting.
    pub fn fill(&mut self) -> bool {
        if self.rx.is_empty() {
            let (rx, spare) = (&mut self.rx, &mut self.rx_spare);
            let got = self.tx.port.rx_burst(RX_BURST, &mut |frame| {
                let mut buf = spare.pop().unwrap_or_default();
                buf.clear();
                buf.extend_from_slice(frame);
                rx.push_back(buf);
            });
            match got {
                Ok(n) => self.rx_frames += n as u64,
                Err(e) => {
                    self.tx.port_errors += 1;
                    tracing::debug!("port receive: {e}");
                }
            }
        }
        !self.rx.is_empty()
    }

    /// Sends every queued frame the port takes; returns whether frames still wait.
    pub fn flush(&mut self) -> bool {
        self.tx.flush()
    }

    /// Lets the next poll take up to a burst of received frames.
    pub fn refill_budget(&mut self) {
        self.rx_budget = RX_BURST;
    }
}

/// A received frame lent to smoltcp.
pub struct RxToken<'a> {
    frame: Vec<u8>,
    spare: &'a mut Vec<Vec<u8>>,
}

/// Room for one frame smoltcp transmits.
pub struct TxToken<'a> {
    tx: &'a mut TxSide,
}

impl phy::RxToken for RxToken<'_> {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        let r = f(&self.frame);
        self.spare.push(self.frame);
        r
    }
}

impl phy::TxToken for TxToken<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut buf = self.tx.spare.pop().unwrap_or_default();
        buf.clear();
        buf.resize(len, 0);
        let r = f(&mut buf);
        self.tx.queue.push_back(buf);
        self.tx.frames += 1;
        if self.tx.queue.len() >= TX_FLUSH {
            self.tx.flush();
        }
        r
    }
}

impl phy::Device for PortDevice {
    type RxToken<'a> = RxToken<'a>;
    type TxToken<'a> = TxToken<'a>;

    fn receive(&mut self, _now: Instant) -> Option<(RxToken<'_>, TxToken<'_>)> {
        if self.rx_budget == 0 || !self.fill() {
            return None;
        }
        self.rx_budget -= 1;
        let mut frame = self.rx.pop_front()?;
        while let Some(room) = syn_port(&frame).and_then(|p| self.backlog_room.get_mut(&p)) {
            if *room > 0 {
                *room -= 1;
                break;
            }
            self.syns_dropped += 1;
            self.rx_spare.push(frame);
            frame = self.rx.pop_front()?;
        }
        Some((RxToken { frame, spare: &mut self.rx_spare }, TxToken { tx: &mut self.tx }))
    }

    fn transmit(&mut self, _now: Instant) -> Option<TxToken<'_>> {
        // Frames the port would not take stay queued; past a bound, smoltcp waits (and TCP
        // retransmits later) rather than the queue growing.
        if self.tx.queue.len() >= 4 * TX_FLUSH && self.tx.flush() {
            return None;
        }
        Some(TxToken { tx: &mut self.tx })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = self.mtu + lanbus_wire::ethernet::HEADER_LEN;
        caps.max_burst_size = Some(TX_FLUSH);
        caps
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanbus_port::{Gso, PortCounters};
    use lanbus_wire::MacAddr;
    use std::sync::{Arc, Mutex};

    /// What a port was asked to send: plain frames and offloaded ones.
    #[derive(Default)]
    struct Sent {
        plain: Vec<Vec<u8>>,
        offloaded: Vec<(Vec<u8>, Gso)>,
    }

    struct Recorder(Arc<Mutex<Sent>>, bool);

    impl Port for Recorder {
        fn rx_burst(&mut self, _max: usize, _on: &mut dyn FnMut(&[u8])) -> lanbus_port::Result<usize> {
            Ok(0)
        }
        fn tx_burst(
            &mut self,
            max: usize,
            fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
        ) -> lanbus_port::Result<usize> {
            let mut n = 0;
            let mut buf = vec![0u8; 70_000];
            while n < max {
                let Some(len) = fill(&mut buf) else { break };
                self.0.lock().unwrap().plain.push(buf[..len].to_vec());
                n += 1;
            }
            Ok(n)
        }
        fn tx_gso(&mut self, frame: &[u8], gso: Gso) -> lanbus_port::Result<bool> {
            if self.1 {
                self.0.lock().unwrap().offloaded.push((frame.to_vec(), gso));
            }
            Ok(self.1)
        }
        fn wait(&mut self, _t: Option<std::time::Duration>) -> lanbus_port::Result<()> {
            Ok(())
        }
        fn mtu(&self) -> usize {
            1500
        }
        fn mac(&self) -> MacAddr {
            MacAddr([2, 0, 0, 0, 0, 1])
        }
        fn counters(&self) -> PortCounters {
            PortCounters::default()
        }
    }

    /// An IPv4 TCP segment of flow `sport` -> 80 at `seq` with `len` payload bytes.
    fn seg(sport: u16, seq: u32, len: usize, flags: u8) -> Vec<u8> {
        let mut f = vec![0u8; 54 + len];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        f[14] = 0x45;
        f[16..18].copy_from_slice(&((40 + len) as u16).to_be_bytes());
        f[20] = 0x40; // DF
        f[22] = 64;
        f[23] = 6;
        f[26..34].copy_from_slice(&[10, 0, 0, 1, 10, 0, 0, 2]);
        f[34..36].copy_from_slice(&sport.to_be_bytes());
        f[36..38].copy_from_slice(&80u16.to_be_bytes());
        f[38..42].copy_from_slice(&seq.to_be_bytes());
        f[46] = 0x50;
        f[47] = flags;
        for (i, b) in f[54..].iter_mut().enumerate() {
            *b = (seq as usize + i) as u8;
        }
        f
    }

    fn device(gso: bool) -> (PortDevice, Arc<Mutex<Sent>>) {
        let sent = Arc::new(Mutex::new(Sent::default()));
        (PortDevice::new(Box::new(Recorder(sent.clone(), gso))), sent)
    }

    #[test]
    fn a_run_of_one_flow_leaves_as_one_offloaded_frame() {
        let (mut dev, sent) = device(true);
        let frames = [
            seg(1000, 0, 10, TCP_ACK), // a lone short segment: plain
            seg(2000, 100, 100, TCP_ACK),
            seg(2000, 200, 100, TCP_ACK),
            seg(2000, 300, 100, TCP_ACK),
            seg(2000, 400, 60, TCP_ACK | TCP_PSH),
            seg(3000, 0, 100, TCP_ACK), // another flow
        ];
        dev.tx.queue.extend(frames.iter().cloned());
        assert!(!dev.flush());
        let sent = sent.lock().unwrap();
        assert_eq!(sent.plain, vec![frames[0].clone(), frames[5].clone()]);
        assert_eq!(sent.offloaded.len(), 1);
        let (f, gso) = &sent.offloaded[0];
        assert_eq!(gso.segment_bytes, 100);
        assert_eq!((gso.csum_start, gso.csum_offset, gso.header_bytes), (34, 16, 54));
        assert_eq!(f.len(), 54 + 360);
        assert_eq!(u16::from_be_bytes([f[16], f[17]]) as usize, 40 + 360);
        assert_eq!(ones_complement(&f[14..34]), 0xffff, "a valid IP header checksum");
        assert_eq!(u32::from_be_bytes(f[38..42].try_into().unwrap()), 100);
        assert_eq!(f[47], TCP_ACK | TCP_PSH);
        let payload: Vec<u8> = frames[1..5].iter().flat_map(|s| s[54..].to_vec()).collect();
        assert_eq!(&f[54..], &payload[..]);
        assert_eq!(dev.counters().offloaded, 1);
    }

    #[test]
    fn without_offload_the_segments_leave_one_by_one() {
        let (mut dev, sent) = device(false);
        let frames: Vec<Vec<u8>> = (0..4).map(|i| seg(2000, i * 100, 100, TCP_ACK)).collect();
        dev.tx.queue.extend(frames.iter().cloned());
        assert!(!dev.flush());
        assert_eq!(sent.lock().unwrap().plain, frames);
        // And it does not ask again.
        assert!(!dev.tx.gso);
    }

    #[test]
    fn gaps_flags_and_short_middles_break_runs() {
        assert!(segment(&seg(1, 0, 0, TCP_ACK)).is_none(), "no payload");
        assert!(segment(&seg(1, 0, 10, TCP_ACK | 0x01)).is_none(), "FIN");
        let (mut dev, sent) = device(true);
        dev.tx.queue.extend([
            seg(2000, 0, 100, TCP_ACK),
            seg(2000, 150, 100, TCP_ACK), // a gap
            seg(2000, 250, 50, TCP_ACK),  // short: ends the run it is in
            seg(2000, 300, 100, TCP_ACK),
        ]);
        assert!(!dev.flush());
        let sent = sent.lock().unwrap();
        assert_eq!(sent.offloaded.len(), 1);
        assert_eq!(sent.offloaded[0].0.len(), 54 + 150);
        assert_eq!(sent.plain.len(), 2);
    }
}
