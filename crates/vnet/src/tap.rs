//! TAP interfaces with the `virtio_net_hdr` in front of every frame (`IFF_VNET_HDR`).
//!
//! Layer: wire (Linux). The I/O box's NIC sends and receives through one ([`TapWire`]), and the
//! host exports its driver as one. The header is [`NET_HDR_LEN`] bytes (`TUNSETVNETHDRSZ`), the
//! same layout as a virtio 1.x buffer's, so offloads pass through untouched; `TUNSETOFFLOAD` says
//! what the kernel may hand over (partial checksums, TCP segments up to 64 KiB), `TUNSETCARRIER`
//! sets the link state. Creating a TAP needs CAP_NET_ADMIN.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::device::{Inbound, NetStats, Offloads, Wire};
use crate::{MAX_BUFFER, NET_HDR_LEN};

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
const TUNSETCARRIER: libc::c_ulong = 0x4004_54e2;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
const TUN_F_CSUM: libc::c_uint = 0x01;
const TUN_F_TSO4: libc::c_uint = 0x02;
const TUN_F_TSO6: libc::c_uint = 0x04;
const TUN_F_TSO_ECN: libc::c_uint = 0x08;

#[repr(C)]
struct IfReq {
    name: [libc::c_char; libc::IFNAMSIZ],
    data: [u8; 24],
}

impl IfReq {
    fn new(name: &str) -> io::Result<IfReq> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(['/', ' ', '\0']) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("bad interface name {name:?}")));
        }
        let mut r = IfReq { name: [0; libc::IFNAMSIZ], data: [0; 24] };
        for (d, s) in r.name.iter_mut().zip(name.bytes()) {
            *d = s as libc::c_char;
        }
        Ok(r)
    }
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// An open TAP interface.
#[derive(Debug)]
pub struct Tap {
    fd: OwnedFd,
    name: String,
}

impl Tap {
    /// Opens (creating it if missing) the TAP `name` with the virtio-net header on every frame.
    pub fn open(name: &str) -> io::Result<Tap> {
        let path = CString::new("/dev/net/tun").unwrap_or_default();
        // SAFETY: a valid NUL-terminated path; the result is checked.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("/dev/net/tun: {e}")));
        }
        // SAFETY: `fd` was just opened and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut req = IfReq::new(name)?;
        req.data[..2].copy_from_slice(&(IFF_TAP | IFF_NO_PI | IFF_VNET_HDR).to_ne_bytes());
        // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is laid out as.
        check(unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, &mut req) })
            .map_err(|e| io::Error::new(e.kind(), format!("TAP {name}: {e} (needs CAP_NET_ADMIN)")))?;
        let hdr = NET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads an int.
        check(unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETVNETHDRSZ, &hdr) })?;
        Ok(Tap { fd, name: name.to_string() })
    }

    /// The interface's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Which offloads the kernel may hand over in frames read from the TAP.
    pub fn set_offloads(&self, o: Offloads) -> io::Result<()> {
        let mut flags = 0;
        if o.csum {
            flags |= TUN_F_CSUM;
            if o.tso4 {
                flags |= TUN_F_TSO4;
            }
            if o.tso6 {
                flags |= TUN_F_TSO6;
            }
            if o.ecn && (o.tso4 || o.tso6) {
                flags |= TUN_F_TSO_ECN;
            }
        }
        // SAFETY: TUNSETOFFLOAD takes the flags as its argument value.
        check(unsafe { libc::ioctl(self.fd.as_raw_fd(), TUNSETOFFLOAD, flags as libc::c_ulong) })
    }

    /// Sets the link's carrier (the interface shows LOWER_UP or NO-CARRIER).
    pub fn set_carrier(&self, up: bool) -> io::Result<()> {
        let v: libc::c_int = up.into();
        // SAFETY: TUNSETCARRIER reads an int.
        check(unsafe { libc::ioctl(self.fd.as_raw_fd(), TUNSETCARRIER, &v) })
    }

    /// Sets the interface's MAC address, MTU and brings it up.
    pub fn configure(&self, mac: Option<[u8; 6]>, mtu: Option<u16>, up: bool) -> io::Result<()> {
        // SAFETY: a plain datagram socket for the interface ioctls; closed by OwnedFd.
        let s = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if s < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: just opened, owned here.
        let s = unsafe { OwnedFd::from_raw_fd(s) };
        if let Some(mac) = mac {
            let mut req = IfReq::new(&self.name)?;
            req.data[..2].copy_from_slice(&(libc::ARPHRD_ETHER).to_ne_bytes());
            req.data[2..8].copy_from_slice(&mac);
            // SAFETY: SIOCSIFHWADDR reads an ifreq with a sockaddr.
            check(unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCSIFHWADDR, &req) })?;
        }
        if let Some(mtu) = mtu {
            let mut req = IfReq::new(&self.name)?;
            req.data[..4].copy_from_slice(&libc::c_int::from(mtu).to_ne_bytes());
            // SAFETY: SIOCSIFMTU reads an ifreq with an int.
            check(unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCSIFMTU, &req) })?;
        }
        if up {
            let mut req = IfReq::new(&self.name)?;
            // SAFETY: SIOCGIFFLAGS fills the ifreq's flags.
            check(unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) })?;
            let flags = i16::from_ne_bytes([req.data[0], req.data[1]]) | libc::IFF_UP as i16;
            req.data[..2].copy_from_slice(&flags.to_ne_bytes());
            // SAFETY: SIOCSIFFLAGS reads the ifreq's flags.
            check(unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCSIFFLAGS, &req) })?;
        }
        Ok(())
    }

    /// Writes one frame (header and Ethernet frame).
    pub fn write(&self, frame: &[u8]) -> io::Result<()> {
        self.write_vectored(&[frame])
    }

    /// Writes one frame given in pieces, in order, with one `writev`.
    pub fn write_vectored(&self, pieces: &[&[u8]]) -> io::Result<()> {
        let iov = iovecs(pieces.iter().map(|p| (p.as_ptr().cast_mut(), p.len())));
        // SAFETY: every iovec names a live slice that outlives the call; writev only reads them.
        let n = unsafe {
            libc::writev(
                self.fd.as_raw_fd(),
                iov.as_ptr(),
                iov.len().min(libc::c_int::MAX as usize) as libc::c_int,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits up to `timeout` for a frame to read; false when none came.
    pub fn wait(&self, timeout: Duration) -> io::Result<bool> {
        wait_readable(self.fd.as_raw_fd(), timeout)
    }

    /// Reads one frame if one is there, straight into `bufs` in order (their lengths together at
    /// least [`MAX_BUFFER`] bytes).
    pub fn read_vectored_now(&self, bufs: &mut [&mut [u8]]) -> io::Result<Option<usize>> {
        let iov = iovecs(bufs.iter_mut().map(|b| (b.as_mut_ptr(), b.len())));
        // SAFETY: every iovec names a live, exclusively borrowed slice that outlives the call;
        // readv writes at most each one's length (the fd is non-blocking).
        let n = unsafe {
            libc::readv(
                self.fd.as_raw_fd(),
                iov.as_ptr(),
                iov.len().min(libc::c_int::MAX as usize) as libc::c_int,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock { Ok(None) } else { Err(e) };
        }
        Ok(Some(n as usize))
    }

    /// Reads one frame into `buf` (at least [`MAX_BUFFER`] bytes), waiting up to `timeout`:
    /// `Ok(None)` when none came.
    pub fn read(&self, buf: &mut [u8], timeout: Duration) -> io::Result<Option<usize>> {
        if !wait_readable(self.fd.as_raw_fd(), timeout)? {
            return Ok(None);
        }
        self.read_now(buf)
    }

    /// Reads one frame if one is there.
    pub fn read_now(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        self.read_vectored_now(&mut [buf])
    }

    /// The file descriptor (for poll).
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// The iovecs of a frame's pieces (more than `IOV_MAX` of them fail with `EINVAL`).
fn iovecs(pieces: impl Iterator<Item = (*mut u8, usize)>) -> Vec<libc::iovec> {
    pieces.map(|(base, len)| libc::iovec { iov_base: base.cast(), iov_len: len }).collect()
}

fn wait_readable(fd: RawFd, timeout: Duration) -> io::Result<bool> {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted { Ok(false) } else { Err(e) };
    }
    Ok(n > 0)
}

/// Frames the device may hand the TAP's writer before it waits for the writer.
const OUTBOUND_FRAMES: usize = 128;

/// The I/O box's wire: a TAP, with a reader thread filling the device's [`Inbound`] queue and a
/// writer thread writing the frames the device sends, so that the device reads its next frames
/// from the host while the kernel takes the last ones.
pub struct TapWire {
    tap: Arc<Tap>,
    inbound: Arc<Inbound>,
    reader: Option<JoinHandle<()>>,
    outbound: Option<std::sync::mpsc::SyncSender<Vec<u8>>>,
    writer: Option<JoinHandle<()>>,
}

impl TapWire {
    /// Opens TAP `name` (MTU `mtu`, up) and starts reading it into a new inbound queue of
    /// `capacity` frames; frames that find it full are counted in `stats.rx_dropped`.
    pub fn open(name: &str, mtu: u16, capacity: usize, stats: Arc<NetStats>) -> io::Result<TapWire> {
        let tap = Arc::new(Tap::open(name)?);
        tap.configure(None, Some(mtu), true)?;
        let inbound = Inbound::new(capacity);
        let (t, q, s) = (tap.clone(), inbound.clone(), stats.clone());
        let reader =
            std::thread::Builder::new().name(format!("nic-{name}")).spawn(move || read_loop(&t, &q, &s))?;
        let (outbound, frames) = std::sync::mpsc::sync_channel::<Vec<u8>>(OUTBOUND_FRAMES);
        let t = tap.clone();
        let writer = std::thread::Builder::new().name(format!("nic-{name}-tx")).spawn(move || {
            // A frame the kernel refuses is counted; the writer ends when the wire is dropped.
            for frame in frames {
                if t.write(&frame).is_err() {
                    stats.tx_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        })?;
        Ok(TapWire { tap, inbound, reader: Some(reader), outbound: Some(outbound), writer: Some(writer) })
    }

    /// The queue the device takes received frames from.
    pub fn inbound(&self) -> Arc<Inbound> {
        self.inbound.clone()
    }

    /// The TAP, shared.
    pub fn tap(&self) -> Arc<Tap> {
        self.tap.clone()
    }
}

fn read_loop(tap: &Tap, inbound: &Inbound, stats: &NetStats) {
    let mut buf = vec![0u8; MAX_BUFFER];
    while !inbound.closed() {
        match tap.read(&mut buf, Duration::from_millis(100)) {
            Ok(Some(n)) if n > NET_HDR_LEN => {
                if !inbound.push(buf[..n].to_vec(), Duration::from_millis(100)) {
                    stats.rx_dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(_) => {}
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

impl Wire for TapWire {
    fn send(&mut self, frame: Vec<u8>) -> io::Result<()> {
        let out = self.outbound.as_ref().ok_or_else(|| io::Error::other("the TAP's writer stopped"))?;
        out.send(frame).map_err(|_| io::Error::other("the TAP's writer stopped"))
    }
    fn set_offloads(&mut self, offloads: Offloads) -> io::Result<()> {
        self.tap.set_offloads(offloads)
    }
}

impl Drop for TapWire {
    fn drop(&mut self) {
        self.inbound.close();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        drop(self.outbound.take());
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}
