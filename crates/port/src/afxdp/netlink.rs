//! Attaching an XDP program the older way, through rtnetlink (`RTM_SETLINK` with a nested
//! `IFLA_XDP`), for kernels without BPF links for XDP (before 5.9) or when asked to.
//!
//! Layer: ports (kernel interface); message layout from `include/uapi/linux/netlink.h`,
//! `rtnetlink.h` and `if_link.h` (`IFLA_XDP_FD`, `IFLA_XDP_FLAGS`, `IFLA_XDP_EXPECTED_FD`).
//!
//! Invariants: attaching sets `XDP_FLAGS_UPDATE_IF_NOEXIST`, so an existing program is never
//! replaced; detaching names our program as the expected one (`XDP_FLAGS_REPLACE` with
//! `IFLA_XDP_EXPECTED_FD`), so a program someone attached after ours is never removed. The
//! netlink socket is opened at attach time and kept: it belongs to the interface's namespace, so
//! detaching works from any thread. Unlike a BPF link, a program attached this way stays if the
//! process dies without dropping the attachment. Kernel error text (extended ACK) is kept in the
//! error.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::bpf::XdpMode;

const NLMSG_ERROR: u16 = 2;
const RTM_SETLINK: u16 = 19;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLA_F_NESTED: u16 = 1 << 15;
const IFLA_XDP: u16 = 43;
const IFLA_XDP_FD: u16 = 1;
const IFLA_XDP_FLAGS: u16 = 3;
const IFLA_XDP_EXPECTED_FD: u16 = 8;
const XDP_FLAGS_UPDATE_IF_NOEXIST: u32 = 1 << 0;
const XDP_FLAGS_SKB_MODE: u32 = 1 << 1;
const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;
const XDP_FLAGS_REPLACE: u32 = 1 << 4;
const SOL_NETLINK: i32 = 270;
const NETLINK_EXT_ACK: i32 = 11;
const NLMSGERR_ATTR_MSG: u16 = 1;
const NLM_F_CAPPED: u16 = 0x100;
const NLM_F_ACK_TLVS: u16 = 0x200;

fn mode_flags(mode: XdpMode) -> u32 {
    match mode {
        XdpMode::Native => XDP_FLAGS_DRV_MODE,
        XdpMode::Generic => XDP_FLAGS_SKB_MODE,
    }
}

/// Appends a netlink attribute (type, payload), padded to 4 bytes.
fn put_attr(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

/// Builds the `RTM_SETLINK` request: `ifinfomsg` for `ifindex`, then `IFLA_XDP` holding `fd`,
/// `flags` and, when given, the expected current program.
pub fn setlink_xdp_request(seq: u32, ifindex: u32, fd: i32, flags: u32, expected_fd: Option<i32>) -> Vec<u8> {
    let mut nested = Vec::new();
    put_attr(&mut nested, IFLA_XDP_FD, &fd.to_ne_bytes());
    put_attr(&mut nested, IFLA_XDP_FLAGS, &flags.to_ne_bytes());
    if let Some(e) = expected_fd {
        put_attr(&mut nested, IFLA_XDP_EXPECTED_FD, &e.to_ne_bytes());
    }
    let mut msg = vec![0u8; 16]; // nlmsghdr, filled in below
                                 // ifinfomsg: family AF_UNSPEC, pad, type, index, flags, change.
    msg.extend_from_slice(&[0, 0, 0, 0]);
    msg.extend_from_slice(&(ifindex as i32).to_ne_bytes());
    msg.extend_from_slice(&[0; 8]);
    put_attr(&mut msg, IFLA_XDP | NLA_F_NESTED, &nested);
    let len = msg.len() as u32;
    msg[0..4].copy_from_slice(&len.to_ne_bytes());
    msg[4..6].copy_from_slice(&RTM_SETLINK.to_ne_bytes());
    msg[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    msg[8..12].copy_from_slice(&seq.to_ne_bytes());
    msg
}

/// Reads the kernel's answer to request `seq`: `Ok` for an ACK, the errno and the kernel's
/// extended-ACK text otherwise. The reply is untrusted input: short or odd messages are errors,
/// never panics.
pub fn parse_ack(reply: &[u8], seq: u32) -> Result<(), (i32, String)> {
    let malformed = || (libc::EBADMSG, "malformed netlink reply".to_string());
    let mut rest = reply;
    while rest.len() >= 16 {
        let u32_at = |b: &[u8], at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let len = u32_at(rest, 0) as usize;
        let kind = u16::from_ne_bytes([rest[4], rest[5]]);
        let flags = u16::from_ne_bytes([rest[6], rest[7]]);
        if len < 16 || len > rest.len() {
            return Err(malformed());
        }
        let msg = &rest[..len];
        rest = &rest[len.next_multiple_of(4).min(rest.len())..];
        if kind != NLMSG_ERROR || u32_at(msg, 8) != seq {
            continue;
        }
        if msg.len() < 20 {
            return Err(malformed());
        }
        let error = i32::from_ne_bytes(msg[16..20].try_into().expect("4 bytes"));
        if error == 0 {
            return Ok(());
        }
        // After the error code: the request's header (and, unless capped, its payload), then
        // attributes when NLM_F_ACK_TLVS is set.
        let mut text = String::new();
        if flags & NLM_F_ACK_TLVS != 0 && msg.len() >= 36 {
            let echoed = if flags & NLM_F_CAPPED != 0 { 16 } else { u32_at(msg, 20) as usize };
            let mut attrs = msg.get(20 + echoed.next_multiple_of(4)..).unwrap_or(&[]);
            while attrs.len() >= 4 {
                let alen = u16::from_ne_bytes([attrs[0], attrs[1]]) as usize;
                let akind = u16::from_ne_bytes([attrs[2], attrs[3]]);
                if alen < 4 || alen > attrs.len() {
                    break;
                }
                if akind == NLMSGERR_ATTR_MSG {
                    let raw = &attrs[4..alen];
                    let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
                    text = String::from_utf8_lossy(&raw[..end]).into_owned();
                }
                attrs = &attrs[alen.next_multiple_of(4).min(attrs.len())..];
            }
        }
        return Err((error.checked_neg().unwrap_or(libc::EINVAL), text));
    }
    Err(malformed())
}

/// The fuzz target's body: reads arbitrary bytes as the reply to request 1. Never panics; an
/// ACK is only reported when the bytes hold a complete error message for that request with code 0.
#[cfg(any(test, fuzzing))]
pub fn fuzz_netlink_ack(data: &[u8]) {
    if parse_ack(data, 1).is_ok() {
        assert!(data.len() >= 20, "an ACK needs a header and an error code");
    }
}

/// An XDP program attached through rtnetlink: detached on drop (if it is still ours).
#[derive(Debug)]
pub struct NetlinkXdp {
    sock: OwnedFd,
    ifindex: u32,
    prog: OwnedFd,
    mode: XdpMode,
    seq: u32,
}

/// An attach or detach failure: the OS error and the kernel's explanation, if it gave one.
#[derive(Debug)]
pub struct NetlinkError {
    /// The error.
    pub source: io::Error,
    /// The kernel's extended-ACK text (may be empty).
    pub message: String,
}

impl NetlinkXdp {
    /// Attaches `prog` (a duplicate is kept, so the program outlives the caller's fd) to
    /// `ifindex` in the calling thread's namespace, refusing to replace an existing program.
    pub fn attach(prog: &OwnedFd, ifindex: u32, mode: XdpMode) -> Result<NetlinkXdp, NetlinkError> {
        let plain = |source: io::Error| NetlinkError { source, message: String::new() };
        let prog = prog.try_clone().map_err(plain)?;
        // SAFETY: plain socket(2) call.
        let raw = unsafe {
            libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE)
        };
        if raw < 0 {
            return Err(plain(io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(raw) };
        let on = 1i32;
        // SAFETY: a live int of the size passed. Failure only loses the kernel's error text.
        unsafe {
            libc::setsockopt(sock.as_raw_fd(), SOL_NETLINK, NETLINK_EXT_ACK, (&raw const on).cast(), 4);
        }
        let mut link = NetlinkXdp { sock, ifindex, prog, mode, seq: 0 };
        let flags = XDP_FLAGS_UPDATE_IF_NOEXIST | mode_flags(mode);
        link.request(link.prog.as_raw_fd(), flags, None)?;
        Ok(link)
    }

    /// The mode the program runs in.
    pub fn mode(&self) -> XdpMode {
        self.mode
    }

    fn request(&mut self, fd: i32, flags: u32, expected: Option<i32>) -> Result<(), NetlinkError> {
        self.seq = self.seq.wrapping_add(1);
        let msg = setlink_xdp_request(self.seq, self.ifindex, fd, flags, expected);
        // SAFETY: the all-zero sockaddr_nl addresses the kernel.
        let mut kernel: libc::sockaddr_nl = unsafe { core::mem::zeroed() };
        kernel.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: `msg` and `kernel` are live for the lengths passed.
        let rc = unsafe {
            libc::sendto(
                self.sock.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&raw const kernel).cast(),
                size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if rc < 0 {
            return Err(NetlinkError { source: io::Error::last_os_error(), message: String::new() });
        }
        let mut buf = vec![0u8; 8192];
        loop {
            // SAFETY: `buf` is writable for its length.
            let n = unsafe { libc::recv(self.sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(NetlinkError { source: e, message: String::new() });
            }
            return match parse_ack(&buf[..n as usize], self.seq) {
                Ok(()) => Ok(()),
                Err((errno, message)) => {
                    Err(NetlinkError { source: io::Error::from_raw_os_error(errno), message })
                }
            };
        }
    }
}

impl Drop for NetlinkXdp {
    fn drop(&mut self) {
        let mode = mode_flags(self.mode);
        let ours = self.prog.as_raw_fd();
        // Remove the program only if it is still ours (Linux 5.7+); older kernels do not know
        // XDP_FLAGS_REPLACE and refuse with EINVAL, and then only a plain removal is possible.
        if let Err(e) = self.request(-1, mode | XDP_FLAGS_REPLACE, Some(ours)) {
            if e.source.raw_os_error() == Some(libc::EINVAL) {
                let _ = self.request(-1, mode, None);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_endian = "little")]
    fn setlink_request_layout() {
        let msg = setlink_xdp_request(7, 3, 9, XDP_FLAGS_UPDATE_IF_NOEXIST | XDP_FLAGS_DRV_MODE, None);
        #[rustfmt::skip]
        let expected: Vec<u8> = vec![
            52, 0, 0, 0,  19, 0,  5, 0,  7, 0, 0, 0,  0, 0, 0, 0,   // nlmsghdr: len, SETLINK, REQUEST|ACK, seq, pid
            0, 0, 0, 0,  3, 0, 0, 0,  0, 0, 0, 0,  0, 0, 0, 0,      // ifinfomsg: index 3
            20, 0, 43, 0x80,                                        // IFLA_XDP | NLA_F_NESTED
            8, 0, 1, 0,  9, 0, 0, 0,                                //   IFLA_XDP_FD 9
            8, 0, 3, 0,  5, 0, 0, 0,                                //   IFLA_XDP_FLAGS
        ];
        assert_eq!(msg, expected);
        let detach = setlink_xdp_request(8, 3, -1, XDP_FLAGS_REPLACE | XDP_FLAGS_DRV_MODE, Some(9));
        assert_eq!(detach.len(), 60);
        assert_eq!(&detach[52..60], &[8, 0, 8, 0, 9, 0, 0, 0]); // IFLA_XDP_EXPECTED_FD 9
    }

    fn error_reply(seq: u32, errno: i32, text: Option<&str>) -> Vec<u8> {
        let mut m = vec![0u8; 16];
        m.extend_from_slice(&(-errno).to_ne_bytes());
        // Echoed request header (capped): len 16, type SETLINK, seq.
        let mut echoed = vec![0u8; 16];
        echoed[0..4].copy_from_slice(&16u32.to_ne_bytes());
        echoed[8..12].copy_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&echoed);
        let mut flags = NLM_F_CAPPED;
        if let Some(t) = text {
            let mut s = t.as_bytes().to_vec();
            s.push(0);
            put_attr(&mut m, NLMSGERR_ATTR_MSG, &s);
            flags |= NLM_F_ACK_TLVS;
        }
        let len = m.len() as u32;
        m[0..4].copy_from_slice(&len.to_ne_bytes());
        m[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        m[6..8].copy_from_slice(&flags.to_ne_bytes());
        m[8..12].copy_from_slice(&seq.to_ne_bytes());
        m
    }

    #[test]
    fn acks_errors_and_kernel_text_are_read() {
        assert_eq!(parse_ack(&error_reply(4, 0, None), 4), Ok(()));
        assert_eq!(parse_ack(&error_reply(4, libc::EBUSY, None), 4), Err((libc::EBUSY, String::new())));
        assert_eq!(
            parse_ack(&error_reply(5, libc::EOPNOTSUPP, Some("native XDP not supported")), 5),
            Err((libc::EOPNOTSUPP, "native XDP not supported".to_string()))
        );
        // A reply to another request is skipped; then nothing is left.
        assert_eq!(parse_ack(&error_reply(4, 0, None), 5).unwrap_err().0, libc::EBADMSG);
    }

    #[test]
    fn random_replies_never_panic() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let seed = error_reply(1, libc::EBUSY, Some("busy"));
        for _ in 0..20_000 {
            // Mutate a valid reply (so the parser gets deep) or make pure noise.
            let mut data = if next() % 4 == 0 { Vec::new() } else { seed.clone() };
            let extra = (next() % 48) as usize;
            data.extend((0..extra).map(|_| next() as u8));
            for _ in 0..(next() % 4) {
                if !data.is_empty() {
                    let at = (next() as usize) % data.len();
                    data[at] = next() as u8;
                }
            }
            fuzz_netlink_ack(&data);
        }
    }

    #[test]
    fn malformed_replies_are_errors_not_panics() {
        let good = error_reply(9, libc::EBUSY, Some("busy"));
        for cut in 0..good.len() {
            let _ = parse_ack(&good[..cut], 9);
        }
        let mut lying = good.clone();
        lying[0..4].copy_from_slice(&4000u32.to_ne_bytes());
        assert_eq!(parse_ack(&lying, 9).unwrap_err().0, libc::EBADMSG);
        let mut bad_attr = good;
        let at = 16 + 4 + 16; // the attribute after header, error code and capped echo
        bad_attr[at..at + 2].copy_from_slice(&200u16.to_ne_bytes());
        assert_eq!(parse_ack(&bad_attr, 9).unwrap_err().0, libc::EBUSY);
    }
}
