//! `shm:/path.sock`: two processes on one machine exchange frames through shared memory
//! (like DPDK's memif).
//!
//! Layer: ports, over `lanbus_ring::pipe`. The first process to open the path creates a memfd
//! region holding two pipes (creator to connector, connector to creator: a packed virtqueue plus a
//! buffer pool each) and two eventfd doorbells, and listens on the Unix socket at the path; the
//! second connects and receives the memfd and the doorbells with `SCM_RIGHTS`. The creator accepts
//! lazily (in any port call) so it never blocks in `open`; frames it sends before the peer arrives
//! wait in the ring. After the peer has connected the socket file is removed, so a later pair can
//! reuse the path. A stale socket file (nobody listening) is replaced.
//!
//! Each frame carries, after its bytes, the wall-clock time its sender wrote it (8 bytes,
//! little-endian ns): the receive timestamp. A frame that waits in the ring waits for this
//! host's threads, not on any wire, so the transport's delay-based rate control does not take
//! a parked thread's wake-up for a queue. A driver that waits on several things at once polls
//! [`Port::readiness_fd`] (an epoll set of the doorbell and, until the peer connects, the
//! listening socket) between [`Port::arm_readiness`] and [`Port::disarm_readiness`].
//!
//! Distrust: the connector validates the region's pipes when attaching; both sides validate every
//! descriptor (`lanbus_ring::pipe`), and a peer's corrupt descriptor is counted in `rx_dropped` /
//! `tx_dropped` instead of crashing the port. Wake-ups use the prepare/re-check/sleep handshake.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use lanbus_ring::pipe::{PipeConfig, Receiver, Sender};
use lanbus_ring::{recv_fds, send_fds, CopyMode, EventFd, Region};
use lanbus_wire::MacAddr;

use crate::{Port, PortCounters, PortError, Result};

/// The MTU of an shm port (Ethernet payload bytes).
pub const SHM_MTU: usize = 1500;

const PIPE: PipeConfig = PipeConfig { slots: 256, buffers: 512, buf_size: 1536 };
const HELLO: &[u8; 8] = b"LBSHM\x02\0\0";
/// The sender's write time after each frame's bytes.
const STAMP_LEN: usize = 8;

fn pipe_offset(k: usize) -> usize {
    k * PIPE.bytes_needed().next_multiple_of(4096)
}

fn ring_err(spec: &str) -> impl Fn(lanbus_ring::Error) -> PortError + '_ {
    move |e| match e {
        lanbus_ring::Error::Io { op, source } => PortError::io(op, source),
        other => PortError::Unavailable { spec: spec.to_string(), why: other.to_string() },
    }
}

/// A shared-memory port; see the module docs.
#[derive(Debug)]
pub struct ShmPort {
    spec: String,
    tx: Sender,
    rx: Receiver,
    /// Rung by the peer when we may have frames.
    my_bell: EventFd,
    /// Rung by us when the peer may have frames.
    peer_bell: EventFd,
    /// The readiness descriptor: an epoll set of `my_bell` and, while pending, the listener.
    ready: OwnedFd,
    /// Creator only, until the peer connects: the listener and the fds to hand over.
    pending: Option<Pending>,
    /// Keeps the connection open (the peer sees EOF when we go).
    _conn: Option<UnixStream>,
    mac: MacAddr,
    counters: PortCounters,
}

#[derive(Debug)]
struct Pending {
    listener: UnixListener,
    path: PathBuf,
    region: Arc<Region>,
}

fn mac_for(path: &Path, creator: bool) -> MacAddr {
    // A locally administered address derived from the path (FNV-1a), last byte the role.
    let mut h: u32 = 0x811c_9dc5;
    for b in path.as_os_str().as_encoded_bytes() {
        h = (h ^ *b as u32).wrapping_mul(0x0100_0193);
    }
    let x = h.to_be_bytes();
    MacAddr([0x02, x[0], x[1], x[2], x[3], if creator { 1 } else { 2 }])
}

impl ShmPort {
    /// Opens `shm:/path.sock`. The creator returns at once; the connector blocks until the creator
    /// makes any port call (`rx_burst`, `tx_burst`, `wait`, `connected`) and hands over the memory.
    pub fn open(spec: &str) -> Result<ShmPort> {
        let path = spec.strip_prefix("shm:").filter(|p| !p.is_empty()).ok_or_else(|| PortError::BadSpec {
            spec: spec.to_string(),
            why: "expected shm:/path/to/socket (the first process to open it creates the link)".to_string(),
        })?;
        let path = Path::new(path);
        for _ in 0..5 {
            match UnixStream::connect(path) {
                Ok(sock) => return Self::connect(spec, path, sock),
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    // Stale socket file: nobody listens. Replace it.
                    let _ = std::fs::remove_file(path);
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(PortError::io("connect shm socket", e)),
            }
            match UnixListener::bind(path) {
                Ok(listener) => return Self::create(spec, path, listener),
                // Another process won the race to create: connect to it instead.
                Err(e) if e.kind() == io::ErrorKind::AddrInUse => continue,
                Err(e) => return Err(PortError::io("bind shm socket", e)),
            }
        }
        Err(PortError::Unavailable {
            spec: spec.to_string(),
            why: "could neither connect nor listen".to_string(),
        })
    }

    fn create(spec: &str, path: &Path, listener: UnixListener) -> Result<ShmPort> {
        listener.set_nonblocking(true).map_err(|e| PortError::io("set_nonblocking", e))?;
        let e = ring_err(spec);
        let region = Arc::new(Region::memfd("lanbus-shm", pipe_offset(2)).map_err(&e)?);
        PIPE.format(&region, pipe_offset(0)).map_err(&e)?;
        PIPE.format(&region, pipe_offset(1)).map_err(&e)?;
        let tx = Sender::attach(region.clone(), pipe_offset(0), CopyMode::Ordinary).map_err(&e)?;
        let rx = Receiver::attach(region.clone(), pipe_offset(1)).map_err(&e)?;
        let my_bell = EventFd::new().map_err(&e)?;
        Ok(ShmPort {
            spec: spec.to_string(),
            tx,
            rx,
            peer_bell: EventFd::new().map_err(&e)?,
            ready: epoll_of(&[my_bell.as_fd().as_raw_fd(), listener.as_raw_fd()])?,
            my_bell,
            pending: Some(Pending { listener, path: path.to_path_buf(), region }),
            _conn: None,
            mac: mac_for(path, true),
            counters: PortCounters::default(),
        })
    }

    fn connect(spec: &str, path: &Path, sock: UnixStream) -> Result<ShmPort> {
        let e = ring_err(spec);
        let mut hello = [0u8; 16];
        let (n, fds) = recv_fds(&sock, &mut hello).map_err(&e)?;
        let bad = |why: &str| PortError::Unavailable { spec: spec.to_string(), why: why.to_string() };
        if n != HELLO.len() || &hello[..n] != HELLO || fds.len() != 3 {
            return Err(bad("the peer did not speak the lanbus shm hello (memfd + two eventfds)"));
        }
        let mut fds = fds.into_iter();
        let (mem, creator_bell, my_bell) = (fds.next(), fds.next(), fds.next());
        let (Some(mem), Some(creator_bell), Some(my_bell)) = (mem, creator_bell, my_bell) else {
            return Err(bad("missing fds"));
        };
        let region = Arc::new(Region::from_fd(mem).map_err(&e)?);
        let rx = Receiver::attach(region.clone(), pipe_offset(0)).map_err(&e)?;
        let tx = Sender::attach(region, pipe_offset(1), CopyMode::Ordinary).map_err(&e)?;
        let my_bell = EventFd::from_fd(my_bell);
        Ok(ShmPort {
            spec: spec.to_string(),
            tx,
            rx,
            ready: epoll_of(&[my_bell.as_fd().as_raw_fd()])?,
            my_bell,
            peer_bell: EventFd::from_fd(creator_bell),
            pending: None,
            _conn: Some(sock),
            mac: mac_for(path, false),
            counters: PortCounters::default(),
        })
    }

    /// Whether the peer has attached (always true on the connecting side).
    pub fn connected(&mut self) -> bool {
        self.try_accept();
        self.pending.is_none()
    }

    /// Creator: hands the memory and doorbells to a peer that has connected.
    fn try_accept(&mut self) {
        let Some(p) = &self.pending else { return };
        let Ok((sock, _)) = p.listener.accept() else { return };
        // Order: [memory, creator's doorbell, connector's doorbell].
        let fds = [p.region.fd().expect("memfd region"), self.my_bell.as_fd(), self.peer_bell.as_fd()];
        if send_fds(&sock, HELLO, &fds).is_ok() {
            let _ = std::fs::remove_file(&p.path);
            self.pending = None;
            self._conn = Some(sock);
        }
    }
}

/// An epoll set of `fds` (readable ones wake it): a single descriptor to poll for all of them.
fn epoll_of(fds: &[RawFd]) -> Result<OwnedFd> {
    // SAFETY: plain syscall; the result is checked.
    let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if raw < 0 {
        return Err(PortError::io("epoll_create1", io::Error::last_os_error()));
    }
    // SAFETY: `raw` is a fresh descriptor nobody else owns.
    let ep = unsafe { OwnedFd::from_raw_fd(raw) };
    for &fd in fds {
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: fd as u64 };
        // SAFETY: `ev` is a live epoll_event; `fd` is open (owned by the port).
        if unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
            return Err(PortError::io("epoll_ctl", io::Error::last_os_error()));
        }
    }
    Ok(ep)
}

impl Drop for ShmPort {
    fn drop(&mut self) {
        if let Some(p) = &self.pending {
            let _ = std::fs::remove_file(&p.path);
        }
    }
}

impl Port for ShmPort {
    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> Result<usize> {
        self.rx_burst_stamped(max, &mut |frame, _| on_frame(frame))
    }

    fn rx_burst_stamped(
        &mut self,
        max: usize,
        on_frame: &mut dyn FnMut(&[u8], Option<u64>),
    ) -> Result<usize> {
        self.try_accept();
        let mut n = 0;
        let mut attempts = 0;
        while n < max && attempts < max {
            attempts += 1;
            let mut len = None;
            let got = self.rx.recv(|f| {
                let Some(at) = f.len().checked_sub(STAMP_LEN) else { return };
                let (frame, stamp) = f.split_at(at);
                let stamp = u64::from_le_bytes(stamp.try_into().expect("8 bytes"));
                len = Some(frame.len());
                on_frame(frame, Some(stamp))
            });
            match got {
                // Shorter than its stamp: a peer's bad frame.
                Ok(true) if len.is_none() => self.counters.rx_dropped += 1,
                Ok(true) => {
                    n += 1;
                    self.counters.rx_frames += 1;
                    self.counters.rx_bytes += len.unwrap_or(0) as u64;
                }
                Ok(false) => break,
                Err(lanbus_ring::Error::Corrupt(_)) => self.counters.rx_dropped += 1,
                Err(e) => return Err(ring_err(&self.spec)(e)),
            }
        }
        Ok(n)
    }

    fn tx_burst(&mut self, max: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> Result<usize> {
        self.try_accept();
        let cap = self.frame_capacity();
        // One clock read per burst, and none for a burst with nothing to send.
        let mut stamp = None;
        let mut n = 0;
        while n < max {
            let sent = self.tx.send_with(|buf| {
                let len = fill(&mut buf[..cap]).filter(|&len| len <= cap)?;
                let stamp = stamp.get_or_insert_with(|| crate::realtime_ns().to_le_bytes());
                buf[len..len + STAMP_LEN].copy_from_slice(stamp);
                Some(len + STAMP_LEN)
            });
            match sent {
                Ok(Some(len)) => {
                    n += 1;
                    self.counters.tx_frames += 1;
                    self.counters.tx_bytes += (len - STAMP_LEN) as u64;
                }
                Ok(None) => break,
                Err(lanbus_ring::Error::Corrupt(_)) => {
                    self.counters.tx_dropped += 1;
                    break;
                }
                Err(e) => return Err(ring_err(&self.spec)(e)),
            }
        }
        if n > 0 && self.tx.wake_needed() {
            self.peer_bell.notify().map_err(ring_err(&self.spec))?;
        }
        Ok(n)
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<()> {
        self.try_accept();
        // Before the peer connects, nobody rings our bell: poll for it in short naps.
        let timeout = if self.pending.is_some() {
            Some(timeout.map_or(Duration::from_millis(10), |t| t.min(Duration::from_millis(10))))
        } else {
            timeout
        };
        self.rx.prepare_wait();
        let r = if self.rx.has_pending() { Ok(()) } else { self.my_bell.wait(timeout).map(|_| ()) };
        self.rx.finish_wait();
        r.map_err(ring_err(&self.spec))
    }

    fn readiness_fd(&self) -> Option<RawFd> {
        Some(self.ready.as_raw_fd())
    }

    fn arm_readiness(&mut self) -> bool {
        self.try_accept();
        self.rx.prepare_wait();
        !self.rx.has_pending()
    }

    fn disarm_readiness(&mut self) {
        self.rx.finish_wait();
        self.my_bell.clear();
        self.try_accept();
    }

    fn mtu(&self) -> usize {
        SHM_MTU
    }

    fn mac(&self) -> MacAddr {
        self.mac
    }

    fn counters(&self) -> PortCounters {
        self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_specs_are_refused() {
        assert!(matches!(ShmPort::open("shm:"), Err(PortError::BadSpec { .. })));
        assert!(matches!(ShmPort::open("udp:1.2.3.4"), Err(PortError::BadSpec { .. })));
    }

    #[test]
    fn frame_fits_a_buffer() {
        assert!(SHM_MTU + lanbus_wire::ethernet::HEADER_LEN + STAMP_LEN <= PIPE.buf_size as usize);
    }

    #[test]
    fn two_ports_in_one_process() {
        let path = std::env::temp_dir().join(format!("lanbus-shm-unit-{}.sock", std::process::id()));
        let spec = format!("shm:{}", path.display());
        let mut a = ShmPort::open(&spec).unwrap();
        // a sends before b exists: the frame waits in the ring.
        assert_eq!(a.send_frames(&[&[7u8; 60]]).unwrap(), 1);
        // The connector waits for the creator to hand over the memory, which the creator does in
        // any port call: open b on another thread while a polls.
        // A creator asleep on its readiness descriptor wakes for the connecting peer. It arms
        // first: arming hands the memory over to a peer that connected already, and the creator
        // then sleeps with nothing left to wake it for.
        assert!(a.arm_readiness());
        let opener = std::thread::spawn(move || ShmPort::open(&spec).unwrap());
        let mut pfd = libc::pollfd { fd: a.readiness_fd().unwrap(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one live pollfd.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 10_000) }, 1, "peer never connected");
        a.disarm_readiness();
        assert!(a.connected());
        let mut b = opener.join().unwrap();
        assert!(!path.exists(), "the socket file is removed once the peer is connected");
        let mut got = Vec::new();
        b.rx_burst(8, &mut |f| got.push(f.to_vec())).unwrap();
        assert_eq!(got, vec![vec![7u8; 60]]);
        assert_eq!(b.send_frames(&[&[1u8; 1514], &[2u8; 1515]]).unwrap(), 1, "over-long frame skipped");
        a.wait(Some(Duration::from_secs(5))).unwrap();
        let mut got = Vec::new();
        a.rx_burst(8, &mut |f| got.push(f.len())).unwrap();
        assert_eq!(got, vec![1514]);
        assert_ne!(a.mac(), b.mac());

        // The readiness descriptor: quiet while armed and empty, readable once the peer sends
        // (the peer rings because we asked), quiet again after disarming.
        let readable = |p: &ShmPort| {
            let mut pfd = libc::pollfd { fd: p.readiness_fd().unwrap(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one live pollfd.
            unsafe { libc::poll(&mut pfd, 1, 0) == 1 }
        };
        assert!(a.arm_readiness(), "nothing waiting");
        assert!(!readable(&a));
        let before = crate::realtime_ns();
        b.send_frames(&[&[3u8; 100]]).unwrap();
        assert!(readable(&a), "the peer rang");
        assert!(!a.arm_readiness(), "a frame is waiting");
        a.disarm_readiness();
        assert!(!readable(&a), "disarming clears the bell");
        // Each frame comes with when its sender wrote it.
        let mut got = Vec::new();
        a.rx_burst_stamped(8, &mut |f, stamp| got.push((f.len(), stamp))).unwrap();
        let (len, stamp) = got[0];
        assert_eq!(len, 100);
        let stamp = stamp.expect("stamped");
        assert!(stamp >= before && stamp <= crate::realtime_ns());
        // A peer's frame too short to hold its stamp is counted and dropped.
        b.tx.send_with(|_| Some(4)).unwrap();
        let dropped = a.counters().rx_dropped;
        assert_eq!(a.rx_burst(8, &mut |_| panic!("no frame")).unwrap(), 0);
        assert_eq!(a.counters().rx_dropped, dropped + 1);
        assert_eq!(a.counters().tx_frames, 1);
        assert_eq!(b.counters().rx_bytes, 60);
    }
}
