//! The virtio-net device of a vhost-user-net backend: a guest's two queues relayed to a
//! [`NetLink`] (in lanbus: the remote NIC's user-space driver, see `lanbus host --export
//! vhost-user-net:PATH`).
//!
//! Layer: device logic beside [`crate::blk`], below the vhost-user plumbing. Virtio 1.2, section
//! 5.1: queue 0 receives, queue 1 transmits, every buffer starts with the 12-byte
//! `virtio_net_hdr` (with `VIRTIO_F_VERSION_1` it always has `num_buffers`). The link speaks the
//! same header, so a frame crosses with one copy each way and its offload fields intact: the
//! guest is offered exactly the offloads the link negotiated with its device. What the guest did
//! not take is undone here: a partial checksum is completed, a coalesced segment it cannot take is
//! dropped and counted. Receive buffers may be single descriptors or chains (Linux's "big packet"
//! mode when the guest takes segmentation offload without mergeable buffers).
//!
//! Everything the guest wrote is distrusted: descriptor addresses and lengths, header fields,
//! chain lengths. A frame that does not fit is dropped and counted; nothing panics.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_net::*;
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemory};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::backend::{pop_chain, signal_guest, Memory};
use crate::blk::Segment;

/// Length of the header before every frame (`struct virtio_net_hdr_mrg_rxbuf`).
pub const NET_HDR_LEN: usize = 12;
/// The largest header and frame a queue carries (a 64 KiB segment and its headers).
pub const MAX_BUFFER: usize = NET_HDR_LEN + 65_550;
/// Received frames held for a guest that has no buffer posted; past this the link waits.
const PENDING_MAX: usize = 512;
/// The receive queue, the transmit queue, and the event that says the link received.
const RX_QUEUE: u16 = 0;
const TX_QUEUE: u16 = 1;
const RX_WAKE: u16 = 3;

/// Header fields (virtio 1.2, 5.1.6).
const FLAGS: usize = 0;
const GSO_TYPE: usize = 1;
const CSUM_START: usize = 6;
const CSUM_OFFSET: usize = 8;
const NUM_BUFFERS: usize = 10;

/// A network interface the backend relays the guest's frames to and from. Frames are a
/// [`NET_HDR_LEN`]-byte `virtio_net_hdr` and an Ethernet frame.
pub trait NetLink: Send + Sync {
    /// The virtio-net offload features the link's frames may use (`VIRTIO_NET_F_*` bits as
    /// negotiated with the link's own device: `CSUM` and `HOST_TSO*` for what it takes,
    /// `GUEST_CSUM` and `GUEST_TSO*` for what it gives).
    fn features(&self) -> u64;
    /// The MAC address of the link's device.
    fn mac(&self) -> [u8; 6];
    /// Its MTU.
    fn mtu(&self) -> u16;
    /// Queues one frame for sending; `Ok(false)` when the link has no room now.
    fn send(&self, frame: &[u8]) -> io::Result<bool>;
    /// Sends what was queued.
    fn flush(&self) -> io::Result<()>;
    /// Waits up to `timeout` for room to send; whether there is some.
    fn wait_room(&self, timeout: Duration) -> io::Result<bool>;
    /// Hands every frame received so far to `f`; how many.
    fn receive(&self, f: &mut dyn FnMut(&[u8])) -> io::Result<usize>;
    /// Waits up to `timeout` for something to receive.
    fn wait_received(&self, timeout: Duration);
}

/// The offload bits the guest is offered on top of the link's: a bit is offered only when the
/// link carries it, and segmentation offload only with the checksum offload it needs.
pub fn offered_features(link: u64) -> u64 {
    let bit = |b: u32| 1u64 << b;
    let mut f = bit(VIRTIO_F_VERSION_1) | bit(VIRTIO_NET_F_MAC) | bit(VIRTIO_NET_F_MTU);
    let pass = |f: &mut u64, bits: &[u32]| {
        for &b in bits {
            *f |= link & bit(b);
        }
    };
    if link & bit(VIRTIO_NET_F_CSUM) != 0 {
        pass(
            &mut f,
            &[VIRTIO_NET_F_CSUM, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6, VIRTIO_NET_F_HOST_ECN],
        );
    }
    if link & bit(VIRTIO_NET_F_GUEST_CSUM) != 0 {
        pass(
            &mut f,
            &[
                VIRTIO_NET_F_GUEST_CSUM,
                VIRTIO_NET_F_GUEST_TSO4,
                VIRTIO_NET_F_GUEST_TSO6,
                VIRTIO_NET_F_GUEST_ECN,
            ],
        );
    }
    f
}

/// Counters of a vhost-user-net backend, over its connections.
#[derive(Debug, Default)]
pub struct NetBackendStats {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// The virtio features the last frontend acknowledged.
    pub acked_features: AtomicU64,
    /// Connections that ended with a protocol error.
    pub protocol_errors: AtomicU64,
    /// Frames the guest sent that went to the link, and their bytes (without the header).
    pub tx_frames: AtomicU64,
    /// See `tx_frames`.
    pub tx_bytes: AtomicU64,
    /// Frames the guest sent that were malformed (too short, too long, unreadable) or that the
    /// link could not take for a second.
    pub tx_dropped: AtomicU64,
    /// Frames given to the guest, and their bytes (without the header).
    pub rx_frames: AtomicU64,
    /// See `rx_frames`.
    pub rx_bytes: AtomicU64,
    /// Frames from the link the guest could not take: too big for its buffer, an offload it did
    /// not accept, a bad header.
    pub rx_dropped: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    // Relaxed: counters only.
    c.fetch_add(n, Ordering::Relaxed);
}

/// Reads the device-readable `segs` of a transmit chain into `buf` (cleared first); false if they
/// hold more than [`MAX_BUFFER`] bytes or lie outside guest memory.
pub fn gather<M: GuestMemory>(mem: &M, segs: &[Segment], buf: &mut Vec<u8>) -> bool {
    buf.clear();
    for s in segs.iter().filter(|s| !s.write) {
        let len = s.len as usize;
        if buf.len() + len > MAX_BUFFER {
            return false;
        }
        let at = buf.len();
        buf.resize(at + len, 0);
        if mem.read_slice(&mut buf[at..], GuestAddress(s.addr)).is_err() {
            return false;
        }
    }
    true
}

/// Writes `frame` across the device-writable `segs` of a receive chain; the bytes written, or
/// `None` if they are too small or lie outside guest memory.
pub fn scatter<M: GuestMemory>(mem: &M, segs: &[Segment], frame: &[u8]) -> Option<u32> {
    let room: u64 = segs.iter().filter(|s| s.write).map(|s| u64::from(s.len)).sum();
    if room < frame.len() as u64 {
        return None;
    }
    let mut done = 0;
    for s in segs.iter().filter(|s| s.write) {
        if done == frame.len() {
            break;
        }
        let n = (s.len as usize).min(frame.len() - done);
        mem.write_slice(&frame[done..done + n], GuestAddress(s.addr)).ok()?;
        done += n;
    }
    Some(done as u32)
}

/// Makes a frame from the link fit what the guest accepted (`acked` feature bits): completes a
/// partial checksum the guest cannot, sets `num_buffers`. False if the guest cannot take it.
pub fn fit_for_guest(frame: &mut [u8], acked: u64) -> bool {
    if frame.len() < NET_HDR_LEN + 14 {
        return false;
    }
    let has = |b: u32| acked & (1u64 << b) != 0;
    let gso = u32::from(frame[GSO_TYPE] & !(VIRTIO_NET_HDR_GSO_ECN as u8));
    let gso_ok = match gso {
        VIRTIO_NET_HDR_GSO_NONE => true,
        VIRTIO_NET_HDR_GSO_TCPV4 => has(VIRTIO_NET_F_GUEST_TSO4),
        VIRTIO_NET_HDR_GSO_TCPV6 => has(VIRTIO_NET_F_GUEST_TSO6),
        _ => false,
    };
    let ecn_ok = frame[GSO_TYPE] & VIRTIO_NET_HDR_GSO_ECN as u8 == 0 || has(VIRTIO_NET_F_GUEST_ECN);
    if !gso_ok || !ecn_ok {
        return false;
    }
    if frame[FLAGS] & VIRTIO_NET_HDR_F_NEEDS_CSUM as u8 != 0 && !has(VIRTIO_NET_F_GUEST_CSUM) {
        if gso != VIRTIO_NET_HDR_GSO_NONE {
            return false;
        }
        let word = |at: usize| usize::from(u16::from_le_bytes([frame[at], frame[at + 1]]));
        let (start, offset) = (word(CSUM_START), word(CSUM_OFFSET));
        let body = &mut frame[NET_HDR_LEN..];
        let Some(field) = start.checked_add(offset).filter(|f| f + 2 <= body.len()) else { return false };
        let sum = !internet_sum(&body[start..]);
        body[field..field + 2].copy_from_slice(&sum.to_be_bytes());
        frame[FLAGS] &= !(VIRTIO_NET_HDR_F_NEEDS_CSUM as u8);
    }
    frame[NUM_BUFFERS..NUM_BUFFERS + 2].copy_from_slice(&1u16.to_le_bytes());
    true
}

/// The ones' complement sum of `data` as 16-bit big-endian words, folded.
fn internet_sum(data: &[u8]) -> u16 {
    let mut sum: u64 =
        data.chunks(2).map(|c| u64::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// The virtio-net device of one vhost-user connection.
pub(crate) struct NetBackend {
    link: Arc<dyn NetLink>,
    mem: Memory,
    acked: AtomicU64,
    /// Frames from the link the guest has not taken yet.
    pending: Mutex<VecDeque<Vec<u8>>>,
    /// Written when `pending` gains frames.
    wake: EventFd,
    stats: Arc<NetBackendStats>,
}

impl NetBackend {
    pub(crate) fn new(link: Arc<dyn NetLink>, mem: Memory, stats: Arc<NetBackendStats>) -> io::Result<Self> {
        Ok(NetBackend {
            link,
            mem,
            acked: AtomicU64::new(0),
            pending: Mutex::new(VecDeque::new()),
            wake: EventFd::new(EFD_NONBLOCK)?,
            stats,
        })
    }

    pub(crate) fn wake_fd(&self) -> &EventFd {
        &self.wake
    }

    pub(crate) fn wake_event() -> u64 {
        u64::from(RX_WAKE)
    }

    fn pending(&self) -> MutexGuard<'_, VecDeque<Vec<u8>>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Moves what the link received into `pending` until `stop`: the connection's receive thread.
    pub(crate) fn receive_loop(&self, stop: &AtomicBool) {
        // Relaxed: polled.
        while !stop.load(Ordering::Relaxed) {
            if self.pending().len() >= PENDING_MAX {
                // The guest is behind: leave frames in the link until it catches up.
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            let mut got = Vec::new();
            match self.link.receive(&mut |f| got.push(f.to_vec())) {
                Ok(0) => self.link.wait_received(Duration::from_millis(100)),
                Ok(_) => {
                    self.pending().extend(got);
                    let _ = self.wake.write(1);
                }
                Err(e) => {
                    tracing::warn!("vhost-user-net: receiving from the link: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    /// Gives pending frames to the guest while it has buffers posted.
    fn deliver(&self, vring: &VringRwLock<Memory>) {
        if !vring.get_ref().is_enabled() {
            return;
        }
        let mem = self.mem.memory();
        let acked = self.acked.load(Ordering::Relaxed);
        let mut used = false;
        loop {
            let Some(mut frame) = self.pending().pop_front() else { break };
            if !fit_for_guest(&mut frame, acked) {
                bump(&self.stats.rx_dropped, 1);
                continue;
            }
            let Some((head, segments)) = pop_chain(vring, &mem) else {
                // No buffer: the guest kicks when it posts one.
                self.pending().push_front(frame);
                break;
            };
            let written = match scatter(&*mem, &segments, &frame) {
                Some(n) => {
                    bump(&self.stats.rx_frames, 1);
                    bump(&self.stats.rx_bytes, (frame.len() - NET_HDR_LEN) as u64);
                    n
                }
                None => {
                    bump(&self.stats.rx_dropped, 1);
                    0
                }
            };
            if let Err(e) = vring.add_used(head, written) {
                tracing::warn!("vhost-user-net: cannot return a receive buffer: {e}");
                return;
            }
            used = true;
        }
        if used {
            signal_guest(vring, "vhost-user-net");
        }
    }

    /// Sends what the guest queued.
    fn transmit(&self, vring: &VringRwLock<Memory>) {
        let mem = self.mem.memory();
        let mut buf = Vec::with_capacity(MAX_BUFFER);
        let mut used = false;
        while let Some((head, segments)) = pop_chain(vring, &mem) {
            if gather(&*mem, &segments, &mut buf) && buf.len() >= NET_HDR_LEN + 14 {
                if self.send(&buf) {
                    bump(&self.stats.tx_frames, 1);
                    bump(&self.stats.tx_bytes, (buf.len() - NET_HDR_LEN) as u64);
                } else {
                    bump(&self.stats.tx_dropped, 1);
                }
            } else {
                bump(&self.stats.tx_dropped, 1);
            }
            if let Err(e) = vring.add_used(head, 0) {
                tracing::warn!("vhost-user-net: cannot return a transmit buffer: {e}");
                break;
            }
            used = true;
        }
        if let Err(e) = self.link.flush() {
            tracing::debug!("vhost-user-net: flushing the link: {e}");
        }
        if used {
            signal_guest(vring, "vhost-user-net");
        }
    }

    /// Sends one frame, waiting up to a second for room.
    fn send(&self, frame: &[u8]) -> bool {
        for _ in 0..100 {
            match self.link.send(frame) {
                Ok(true) => return true,
                Ok(false) => {
                    let _ = self.link.flush();
                    if !self.link.wait_room(Duration::from_millis(10)).unwrap_or(false) {
                        continue;
                    }
                }
                Err(e) => {
                    tracing::debug!("vhost-user-net: the link refused a frame: {e}");
                    return false;
                }
            }
        }
        false
    }
}

impl VhostUserBackend for NetBackend {
    type Bitmap = ();
    type Vring = VringRwLock<Memory>;

    fn num_queues(&self) -> usize {
        2
    }

    fn max_queue_size(&self) -> usize {
        crate::backend::MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        offered_features(self.link.features()) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn acked_features(&self, features: u64) {
        // Relaxed: set during negotiation, before the queues start.
        self.acked.store(features, Ordering::Relaxed);
        self.stats.acked_features.store(features, Ordering::Relaxed);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::REPLY_ACK
    }

    fn set_event_idx(&self, _enabled: bool) {
        // Not offered: every kick and every used buffer is signalled.
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        // struct virtio_net_config: mac[6], status, max_virtqueue_pairs, mtu.
        let mut c = [0u8; 12];
        c[..6].copy_from_slice(&self.link.mac());
        c[6..8].copy_from_slice(&(VIRTIO_NET_S_LINK_UP as u16).to_le_bytes());
        c[8..10].copy_from_slice(&1u16.to_le_bytes());
        c[10..12].copy_from_slice(&self.link.mtu().to_le_bytes());
        (u64::from(offset)..u64::from(offset) + u64::from(size))
            .map(|i| usize::try_from(i).ok().and_then(|i| c.get(i).copied()).unwrap_or(0))
            .collect()
    }

    fn update_memory(&self, _mem: Memory) -> io::Result<()> {
        Ok(())
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Self::Vring],
        _thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Ok(());
        }
        match device_event {
            RX_QUEUE | RX_WAKE => {
                if device_event == RX_WAKE {
                    let _ = self.wake.read();
                }
                if let Some(rx) = vrings.get(usize::from(RX_QUEUE)) {
                    self.deliver(rx);
                }
            }
            TX_QUEUE => {
                if let Some(tx) = vrings.get(usize::from(TX_QUEUE)) {
                    self.transmit(tx);
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// Runs the transmit and receive paths on fuzzer bytes: guest memory, descriptor lists and link
/// frames from `data`. Never panics.
pub fn fuzz_frames(data: &[u8]) {
    use vm_memory::GuestMemoryMmap;
    if data.len() < 4 {
        return;
    }
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 16)]).unwrap();
    let (head, rest) = data.split_at(4);
    let _ = mem.write_slice(&rest[..rest.len().min(1 << 16)], GuestAddress(0));
    let segs: Vec<Segment> = rest
        .chunks_exact(7)
        .take(usize::from(head[0] % 16))
        .map(|c| Segment {
            addr: u64::from(u32::from_le_bytes([c[0], c[1], c[2], 0])) << (c[6] >> 6),
            len: u32::from(u16::from_le_bytes([c[3], c[4]])) << (c[5] % 4),
            write: c[6] & 1 != 0,
        })
        .collect();
    let mut buf = Vec::new();
    if gather(&mem, &segs, &mut buf) {
        let acked = u64::from(u32::from_le_bytes([head[0], head[1], head[2], head[3]])) << 8;
        if fit_for_guest(&mut buf, acked) {
            let _ = scatter(&mem, &segs, &buf);
        }
    }
    let mut frame = rest.to_vec();
    let _ = fit_for_guest(&mut frame, u64::from(head[1]));
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use vm_memory::GuestMemoryMmap;

    proptest! {
        /// What is scattered over any chain of writable buffers inside guest memory gathers back
        /// the same (reading them as the device-readable side would).
        #[test]
        fn scatter_then_gather_is_the_identity(
            frame in proptest::collection::vec(any::<u8>(), NET_HDR_LEN + 14..3000),
            lens in proptest::collection::vec(1u32..2000, 1..6),
        ) {
            let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 16)]).unwrap();
            let segs: Vec<Segment> =
                lens.iter().enumerate().map(|(i, &len)| Segment { addr: i as u64 * 0x2000, len, write: true }).collect();
            let room: u32 = lens.iter().sum();
            let written = scatter(&mem, &segs, &frame);
            if room as usize >= frame.len() {
                prop_assert_eq!(written, Some(frame.len() as u32));
                let mut back = Vec::new();
                let used: Vec<Segment> = segs.iter().map(|s| Segment { write: false, ..*s }).collect();
                prop_assert!(gather(&mem, &used, &mut back));
                prop_assert_eq!(&back[..frame.len()], &frame[..]);
            } else {
                prop_assert_eq!(written, None);
            }
        }

        /// Any header from the link either fits the guest or is refused; a checksum completed
        /// for the guest is the right one (summing the frame's covered range gives all ones).
        #[test]
        fn link_headers_never_panic_and_completed_checksums_verify(
            mut frame in proptest::collection::vec(any::<u8>(), 0..200),
            acked in any::<u64>(),
            start in 0u16..80,
            offset in 0u16..80,
        ) {
            // Mostly ranges that lie inside the frame, so completion is exercised.
            if frame.len() >= NET_HDR_LEN && offset % 2 == 0 {
                frame[CSUM_START..CSUM_START + 2].copy_from_slice(&start.to_le_bytes());
                frame[CSUM_OFFSET..CSUM_OFFSET + 2].copy_from_slice(&offset.to_le_bytes());
            }
            let partial = frame.first().is_some_and(|f| f & VIRTIO_NET_HDR_F_NEEDS_CSUM as u8 != 0);
            let before = frame.clone();
            if fit_for_guest(&mut frame, acked) {
                prop_assert_eq!(u16::from_le_bytes([frame[NUM_BUFFERS], frame[NUM_BUFFERS + 1]]), 1);
                if partial && acked & (1 << VIRTIO_NET_F_GUEST_CSUM) == 0 {
                    prop_assert_eq!(frame[FLAGS] & VIRTIO_NET_HDR_F_NEEDS_CSUM as u8, 0);
                    let word = |at: usize| usize::from(u16::from_le_bytes([frame[at], frame[at + 1]]));
                    let (start, field) = (word(CSUM_START), word(CSUM_START) + word(CSUM_OFFSET));
                    prop_assert_eq!(verify(&frame, &before, start, field), 0xffff);
                }
            }
        }
    }

    /// What a receiver checks: the covered range as completed plus the partial sum the field held
    /// before (the pseudo-header's, which the range does not include).
    fn verify(after: &[u8], before: &[u8], start: usize, field: usize) -> u16 {
        let at = NET_HDR_LEN + field;
        let old = u32::from(u16::from_be_bytes([before[at], before[at + 1]]));
        let mut s = u32::from(internet_sum(&after[NET_HDR_LEN + start..])) + old;
        while s > 0xffff {
            s = (s & 0xffff) + (s >> 16);
        }
        s as u16
    }

    #[test]
    fn a_completed_checksum_sums_to_all_ones() {
        let mut frame = vec![0u8; NET_HDR_LEN + 60];
        for (i, b) in frame[NET_HDR_LEN..].iter_mut().enumerate() {
            *b = (i * 31 + 7) as u8;
        }
        frame[FLAGS] = VIRTIO_NET_HDR_F_NEEDS_CSUM as u8;
        frame[CSUM_START..CSUM_START + 2].copy_from_slice(&20u16.to_le_bytes());
        frame[CSUM_OFFSET..CSUM_OFFSET + 2].copy_from_slice(&16u16.to_le_bytes());
        let before = frame.clone();
        assert!(fit_for_guest(&mut frame, 0));
        assert_eq!(frame[FLAGS], 0);
        assert_eq!(verify(&frame, &before, 20, 36), 0xffff);
        // Its range running past the frame: refused.
        frame[FLAGS] = VIRTIO_NET_HDR_F_NEEDS_CSUM as u8;
        frame[CSUM_OFFSET..CSUM_OFFSET + 2].copy_from_slice(&60u16.to_le_bytes());
        assert!(!fit_for_guest(&mut frame, 0));
    }
}
