//! The `udp` port: lanbus frames inside UDP datagrams, the kernel-socket baseline.
//!
//! Layer: ports. The Ethernet payload of a lanbus frame (lanbus header and data) travels as one
//! UDP datagram; the 14-byte Ethernet header does not. On receive the port rebuilds it, so the
//! layer above sees the same frames as on raw Ethernet:
//!
//! - destination: this port's MAC (a frame the sender broadcast arrives addressed to us),
//! - source: the MAC the peer table gives for the datagram's source address,
//! - EtherType: 0x88B5.
//!
//! On transmit the destination MAC picks the datagram's destination: a named peer's address for
//! unicast; every peer (and the optional UDP broadcast address) for broadcast and multicast. A
//! frame for a MAC that is not in the table is counted in `tx_dropped` and in
//! [`UdpPort::unknown_destinations`]; a frame of another EtherType is dropped and counted too (the
//! datagram could not say what it was).
//!
//! Peers are named explicitly because UDP has no address resolution of its own. A datagram from a
//! source that is not in the table is counted ([`UdpPort::unknown_senders`]) and dropped, unless
//! the port was opened with `learn`: then the sender is added to the table with the MAC derived
//! from its address ([`derived_mac`], the same rule a port uses for its own MAC when `mac=` is not
//! given), up to [`MAX_LEARNED_PEERS`]. Learning is off by default: a port should not take frames
//! from whoever can reach its UDP port.
//!
//! Broadcast over IP: a socket bound to a specific address does not receive IPv4 broadcasts, so a
//! port meant to hear `bcast=` traffic binds `0.0.0.0` and therefore names its own MAC (`mac=`).
//! Senders it learns get MACs derived from their addresses, which match their own only if they
//! bound a specific address without `mac=`. A peer that is both named and reached through the
//! broadcast address receives each broadcast frame twice (the transport drops duplicates).
//!
//! Invariants: the socket is non-blocking; datagrams move in batches of [`BATCH`] with
//! `recvmmsg`/`sendmmsg`; a datagram longer than the MTU (seen as `MSG_TRUNC`) or shorter than the
//! lanbus header is dropped and counted; frames the kernel could not take yet (`EAGAIN`, for
//! example while datagrams wait for ARP and hold the socket's send buffer) stay queued in the port
//! and go first on the next `tx_burst` or `rx_burst`; `tx_burst` takes no new frames until they
//! are gone, and `wait` also wakes when the socket can take them, so a driver loop that keeps
//! calling the port sends them without new frames to push. The hot path does not allocate (the
//! pending queue grows only when the peer table does).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::Duration;

use lanbus_wire::ethernet::HEADER_LEN;
use lanbus_wire::{EtherType, MacAddr};

use crate::check::{check_frame, check_tx_frame, MIN_PAYLOAD_BYTES};
use crate::{Port, PortCounters, PortError, Result};

/// Datagrams per `recvmmsg`/`sendmmsg` call.
pub const BATCH: usize = 64;

/// Most peers a port learns (with `learn`) on top of the named ones.
pub const MAX_LEARNED_PEERS: usize = 1024;

/// Default MTU for IPv4: a 1500-byte link minus the IPv4 (20) and UDP (8) headers, so datagrams
/// are never fragmented on an ordinary Ethernet path.
pub const DEFAULT_MTU_V4: usize = 1472;
/// Default MTU for IPv6: 1500 minus the IPv6 (40) and UDP (8) headers.
pub const DEFAULT_MTU_V6: usize = 1452;
/// Largest MTU: the largest UDP payload of an IPv4 datagram.
pub const MAX_MTU: usize = 65_507;

/// Socket buffer size asked for (the kernel caps it at `net.core.rmem_max`/`wmem_max`).
const SOCKET_BUFFER_BYTES: libc::c_int = 4 << 20;

/// A named peer: the MAC its frames carry and the UDP address they come from and go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpPeer {
    /// The peer's MAC address.
    pub mac: MacAddr,
    /// The peer's UDP socket address.
    pub addr: SocketAddr,
}

/// How to open a [`UdpPort`]; [`UdpConfig::parse`] reads it from the part of a spec after `udp:`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdpConfig {
    /// The local address to bind (a specific address, so that peers can name it).
    pub bind: SocketAddr,
    /// This port's MAC; `None` derives it from the bound address ([`derived_mac`]).
    pub mac: Option<MacAddr>,
    /// The peers frames go to and come from.
    pub peers: Vec<UdpPeer>,
    /// A UDP broadcast address that broadcast frames also go to (`SO_BROADCAST` is set).
    pub broadcast: Option<SocketAddr>,
    /// Whether datagrams from unknown senders add them to the peer table.
    pub learn: bool,
    /// The largest Ethernet payload carried; `None` is [`DEFAULT_MTU_V4`] or [`DEFAULT_MTU_V6`].
    pub mtu: Option<usize>,
}

impl UdpConfig {
    /// A port bound to `bind` with no peers, derived MAC, default MTU, no learning.
    pub fn new(bind: SocketAddr) -> Self {
        UdpConfig { bind, mac: None, peers: Vec::new(), broadcast: None, learn: false, mtu: None }
    }

    /// Parses `BIND_IP:PORT[,peer=[MAC@]IP:PORT]...[,mac=MAC][,bcast=IP:PORT][,learn][,mtu=N]`
    /// (the spec without its `udp:` prefix). The error says what is wrong.
    pub fn parse(args: &str) -> core::result::Result<UdpConfig, String> {
        let mut parts = args.split(',');
        let bind_s = parts.next().unwrap_or("").trim();
        if bind_s.is_empty() {
            return Err("expected udp:BIND_IP:PORT[,peer=[MAC@]IP:PORT]... (for example \
                        udp:127.0.0.1:7000,peer=127.0.0.1:7001)"
                .into());
        }
        let bind = parse_socket_addr(bind_s, "bind address")?;
        let mut config = UdpConfig::new(bind);
        for part in parts {
            let part = part.trim();
            let (key, value) = match part.split_once('=') {
                Some((k, v)) => (k.trim(), Some(v.trim())),
                None => (part, None),
            };
            match (key, value) {
                ("peer", Some(v)) => {
                    let peer = match v.split_once('@') {
                        Some((mac, addr)) => {
                            let addr = parse_socket_addr(addr, "peer address")?;
                            let mac = parse_mac(mac)?;
                            UdpPeer { mac, addr }
                        }
                        None => {
                            let addr = parse_socket_addr(v, "peer address")?;
                            UdpPeer { mac: derived_mac(addr), addr }
                        }
                    };
                    config.peers.push(peer);
                }
                ("mac", Some(v)) => config.mac = Some(parse_mac(v)?),
                ("bcast", Some(v)) => config.broadcast = Some(parse_socket_addr(v, "broadcast address")?),
                ("learn", None) => config.learn = true,
                ("mtu", Some(v)) => {
                    let mtu: usize = v
                        .parse()
                        .map_err(|_| format!("mtu={v:?} is not a number of bytes (e.g. mtu=1472)"))?;
                    config.mtu = Some(mtu);
                }
                _ => {
                    return Err(format!(
                        "unknown option {part:?}; options are peer=[MAC@]IP:PORT, mac=MAC, bcast=IP:PORT, \
                         learn, mtu=BYTES"
                    ))
                }
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks the configuration for mistakes that a bind would not catch.
    pub fn validate(&self) -> core::result::Result<(), String> {
        let v4 = self.bind.is_ipv4();
        if self.mac.is_none() && self.bind.ip().is_unspecified() {
            return Err(format!(
                "bind address {} is unspecified, so peers cannot derive this port's MAC from it: bind the \
                 address peers send to (e.g. udp:10.0.0.2:7000) or give mac=MAC",
                self.bind.ip()
            ));
        }
        if let Some(mac) = self.mac {
            if mac.is_multicast() {
                return Err(format!("mac={mac} is a multicast address; a port needs a unicast MAC"));
            }
        }
        for (i, p) in self.peers.iter().enumerate() {
            if p.addr.is_ipv4() != v4 {
                return Err(format!(
                    "peer {} and bind address {} are of different IP versions; use one version",
                    p.addr, self.bind
                ));
            }
            if p.addr.port() == 0 || p.addr.ip().is_unspecified() {
                return Err(format!("peer {} needs a specific IP address and a port other than 0", p.addr));
            }
            if p.mac.is_multicast() {
                return Err(format!("peer MAC {} is a multicast address; peers have unicast MACs", p.mac));
            }
            if p.addr == self.bind {
                return Err(format!("peer {} is this port's own address", p.addr));
            }
            for q in &self.peers[..i] {
                if q.addr == p.addr || q.mac == p.mac {
                    return Err(format!(
                        "peers {}@{} and {}@{} share a MAC or an address; each peer needs its own",
                        q.mac, q.addr, p.mac, p.addr
                    ));
                }
            }
        }
        if let Some(b) = self.broadcast {
            if b.is_ipv4() != v4 || !v4 {
                return Err(format!(
                    "bcast={b}: UDP broadcast needs an IPv4 bind address and an IPv4 broadcast address"
                ));
            }
        }
        if let Some(mtu) = self.mtu {
            if !(MIN_PAYLOAD_BYTES..=MAX_MTU).contains(&mtu) {
                return Err(format!("mtu={mtu} is out of range {MIN_PAYLOAD_BYTES}..={MAX_MTU}"));
            }
        }
        Ok(())
    }
}

fn parse_socket_addr(s: &str, what: &str) -> core::result::Result<SocketAddr, String> {
    s.trim().parse().map_err(|_| {
        format!("{what} {s:?} is not IP:PORT (IPv4 as 10.0.0.2:7000, IPv6 as [fd00::2]:7000; no host names)")
    })
}

fn parse_mac(s: &str) -> core::result::Result<MacAddr, String> {
    s.trim().parse().map_err(|_| format!("{s:?} is not a MAC address (write it as 02:4c:55:00:00:01)"))
}

/// The MAC a `udp` port uses for `addr` when none is given: locally administered and unicast,
/// `02:4c:55:` followed by 24 bits of an FNV-1a hash of the IP address and port. Every port
/// computes the same MAC for the same address, so peers named without a MAC agree with the MAC
/// the port at that address gives itself.
pub fn derived_mac(addr: SocketAddr) -> MacAddr {
    let mut h: u32 = 0x811c_9dc5;
    let mut eat = |b: u8| {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    };
    match addr.ip() {
        IpAddr::V4(ip) => ip.octets().into_iter().for_each(&mut eat),
        IpAddr::V6(ip) => ip.octets().into_iter().for_each(&mut eat),
    }
    addr.port().to_be_bytes().into_iter().for_each(&mut eat);
    let b = h.to_be_bytes();
    MacAddr([0x02, 0x4c, 0x55, b[1] ^ b[0], b[2], b[3]])
}

/// A socket address in the kernel's form, ready to hand to `sendmmsg`.
#[derive(Clone, Copy)]
struct RawAddr {
    storage: libc::sockaddr_storage,
    len: libc::socklen_t,
}

impl RawAddr {
    fn new(addr: SocketAddr) -> RawAddr {
        // SAFETY: sockaddr_storage is plain old data for which all-zero bytes are valid.
        let mut storage: libc::sockaddr_storage = unsafe { core::mem::zeroed() };
        let len = match addr {
            SocketAddr::V4(a) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                    sin_zero: [0; 8],
                };
                // SAFETY: sockaddr_storage is larger than and aligned at least as strictly as
                // sockaddr_in, so the write stays inside `storage`.
                unsafe { core::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in, sin) };
                core::mem::size_of::<libc::sockaddr_in>()
            }
            SocketAddr::V6(a) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo(),
                    sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                    sin6_scope_id: a.scope_id(),
                };
                // SAFETY: as above, for sockaddr_in6.
                unsafe { core::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in6, sin6) };
                core::mem::size_of::<libc::sockaddr_in6>()
            }
        };
        RawAddr { storage, len: len as libc::socklen_t }
    }
}

/// Reads a socket address the kernel wrote; `None` for a family other than IPv4/IPv6 or a length
/// too short for its family.
fn socket_addr_from_raw(storage: &libc::sockaddr_storage, len: libc::socklen_t) -> Option<SocketAddr> {
    let len = len as usize;
    match i32::from(storage.ss_family) {
        libc::AF_INET if len >= core::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: the family says the kernel wrote a sockaddr_in, and sockaddr_storage is
            // large and aligned enough to hold one.
            let sin = unsafe { &*(storage as *const _ as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 if len >= core::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe { &*(storage as *const _ as *const libc::sockaddr_in6) };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// A datagram accepted for sending that the kernel has not taken yet.
struct Pending {
    /// Transmit slot holding the frame (payload at `HEADER_LEN`).
    slot: usize,
    /// Payload length (the datagram's length).
    len: usize,
    /// Where it goes.
    to: RawAddr,
}

/// The kernel-socket port; see the module docs.
pub struct UdpPort {
    socket: UdpSocket,
    local: SocketAddr,
    mac: MacAddr,
    mtu: usize,
    learn: bool,
    learned: usize,
    by_addr: HashMap<SocketAddr, MacAddr>,
    by_mac: HashMap<MacAddr, RawAddr>,
    /// Everyone a broadcast frame goes to: the peers, then the broadcast address.
    fan_out: Vec<RawAddr>,
    /// Bytes per slot: an Ethernet header and an MTU of payload.
    stride: usize,
    rx_buf: Vec<u8>,
    rx_names: Vec<libc::sockaddr_storage>,
    tx_buf: Vec<u8>,
    pending: Vec<Pending>,
    pending_head: usize,
    counters: PortCounters,
    unknown_senders: u64,
    unknown_destinations: u64,
    last_tx_error: Option<std::io::Error>,
}

impl core::fmt::Debug for UdpPort {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("UdpPort")
            .field("local", &self.local)
            .field("mac", &self.mac)
            .field("mtu", &self.mtu)
            .field("peers", &self.by_addr)
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

fn set_int_option(
    fd: libc::c_int,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> std::io::Result<()> {
    // SAFETY: the pointer and length describe a live c_int for the duration of the call.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            &value as *const libc::c_int as *const libc::c_void,
            core::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl UdpPort {
    /// Binds the socket and builds the peer table. Errors say what is wrong with the address
    /// (in use, not on this machine, privileged) and how to fix it.
    pub fn open(config: &UdpConfig) -> Result<UdpPort> {
        let spec = format!("udp:{}", config.bind);
        config.validate().map_err(|why| PortError::BadSpec { spec: spec.clone(), why })?;
        let socket = UdpSocket::bind(config.bind).map_err(|e| {
            let why = match e.kind() {
                std::io::ErrorKind::AddrInUse => format!(
                    "{} is already in use by another socket (another lanbus?): pick another port",
                    config.bind
                ),
                std::io::ErrorKind::AddrNotAvailable => format!(
                    "{} is not an address of this machine (`ip addr` lists them): bind one of those",
                    config.bind.ip()
                ),
                std::io::ErrorKind::PermissionDenied => format!(
                    "binding {} was refused: UDP ports below 1024 need root; use a port of 1024 or above",
                    config.bind
                ),
                _ => format!("cannot bind {}: {e}", config.bind),
            };
            PortError::Unavailable { spec: spec.clone(), why }
        })?;
        socket.set_nonblocking(true).map_err(|e| PortError::io("set O_NONBLOCK on the UDP socket", e))?;
        let fd = socket.as_raw_fd();
        // Bigger buffers absorb bursts; the kernel caps them at its maximum, which is fine.
        let _ = set_int_option(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, SOCKET_BUFFER_BYTES);
        let _ = set_int_option(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, SOCKET_BUFFER_BYTES);
        if config.broadcast.is_some() {
            socket.set_broadcast(true).map_err(|e| PortError::io("set SO_BROADCAST", e))?;
        }
        let local = socket.local_addr().map_err(|e| PortError::io("getsockname on the UDP socket", e))?;
        let mtu = config.mtu.unwrap_or(if local.is_ipv4() { DEFAULT_MTU_V4 } else { DEFAULT_MTU_V6 });
        let stride = HEADER_LEN + mtu;
        // SAFETY: sockaddr_storage is plain old data for which all-zero bytes are valid.
        let zero_name: libc::sockaddr_storage = unsafe { core::mem::zeroed() };
        let mut port = UdpPort {
            socket,
            local,
            mac: config.mac.unwrap_or_else(|| derived_mac(local)),
            mtu,
            learn: config.learn,
            learned: 0,
            by_addr: HashMap::new(),
            by_mac: HashMap::new(),
            fan_out: Vec::new(),
            stride,
            rx_buf: vec![0; stride * BATCH],
            rx_names: vec![zero_name; BATCH],
            tx_buf: vec![0; stride * BATCH],
            pending: Vec::new(),
            pending_head: 0,
            counters: PortCounters::default(),
            unknown_senders: 0,
            unknown_destinations: 0,
            last_tx_error: None,
        };
        if let Some(b) = config.broadcast {
            port.fan_out.push(RawAddr::new(b));
        }
        for p in &config.peers {
            port.add_peer(p.mac, p.addr)?;
        }
        Ok(port)
    }

    /// Adds a peer to the table (for callers that learn addresses another way, and for tests that
    /// bind port 0). Fails if the MAC or the address is already taken or of the wrong IP version.
    pub fn add_peer(&mut self, mac: MacAddr, addr: SocketAddr) -> Result<()> {
        if addr.is_ipv4() != self.local.is_ipv4() || mac.is_multicast() || addr == self.local {
            return Err(PortError::Misuse(format!(
                "peer {mac}@{addr} does not fit this port ({}, {}): same IP version, unicast MAC, not itself",
                self.mac, self.local
            )));
        }
        if self.by_addr.contains_key(&addr) || self.by_mac.contains_key(&mac) {
            return Err(PortError::Misuse(format!(
                "peer {mac}@{addr}: the MAC or the address is already a peer"
            )));
        }
        let raw = RawAddr::new(addr);
        self.by_addr.insert(addr, mac);
        self.by_mac.insert(mac, raw);
        // Peers go before the broadcast address; order does not matter to receivers.
        self.fan_out.insert(0, raw);
        // Room for a full batch of broadcasts, so the queue never grows on the hot path.
        self.pending.reserve((BATCH * self.fan_out.len()).saturating_sub(self.pending.len()));
        Ok(())
    }

    /// The address the socket is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The peers in the table (named and learned), as (MAC, address).
    pub fn peers(&self) -> impl Iterator<Item = (MacAddr, SocketAddr)> + '_ {
        self.by_addr.iter().map(|(a, m)| (*m, *a))
    }

    /// Datagrams dropped because their source is not in the peer table (and was not learned).
    /// They are also counted in `rx_dropped`.
    pub fn unknown_senders(&self) -> u64 {
        self.unknown_senders
    }

    /// Frames dropped because their destination MAC is not in the peer table. They are also
    /// counted in `tx_dropped`.
    pub fn unknown_destinations(&self) -> u64 {
        self.unknown_destinations
    }

    /// The last error `sendmmsg` gave for a datagram it dropped (unreachable network, refused
    /// broadcast...), for diagnostics.
    pub fn last_tx_error(&self) -> Option<&std::io::Error> {
        self.last_tx_error.as_ref()
    }

    /// Whether datagrams accepted earlier still wait for room in the kernel.
    pub fn has_pending(&self) -> bool {
        self.pending_head < self.pending.len()
    }

    /// Receives up to `want` (<= BATCH) datagrams into the receive slots; returns the headers.
    fn receive_batch(&mut self, want: usize, hdrs: &mut [libc::mmsghdr; BATCH]) -> Result<usize> {
        // SAFETY: iovec is plain old data; all-zero is a valid (empty) value.
        let mut iovs: [libc::iovec; BATCH] = unsafe { core::mem::zeroed() };
        let base = self.rx_buf.as_mut_ptr();
        for i in 0..want {
            // SAFETY: slot i spans [i*stride, (i+1)*stride) inside rx_buf (BATCH slots), so the
            // payload area starting HEADER_LEN into it and `mtu` long is in bounds.
            let payload = unsafe { base.add(i * self.stride + HEADER_LEN) };
            iovs[i] = libc::iovec { iov_base: payload.cast(), iov_len: self.mtu };
            let h = &mut hdrs[i];
            h.msg_len = 0;
            h.msg_hdr.msg_name = &mut self.rx_names[i] as *mut _ as *mut libc::c_void;
            h.msg_hdr.msg_namelen = core::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            h.msg_hdr.msg_iov = &mut iovs[i];
            h.msg_hdr.msg_iovlen = 1;
            h.msg_hdr.msg_control = core::ptr::null_mut();
            h.msg_hdr.msg_controllen = 0;
            h.msg_hdr.msg_flags = 0;
        }
        loop {
            // SAFETY: hdrs[..want] point at live iovecs and names that outlive the call, and each
            // iovec covers memory inside rx_buf that nothing else borrows during the call.
            let rc = unsafe {
                libc::recvmmsg(
                    self.socket.as_raw_fd(),
                    hdrs.as_mut_ptr(),
                    want as libc::c_uint,
                    libc::MSG_DONTWAIT,
                    core::ptr::null_mut(),
                )
            };
            if rc >= 0 {
                return Ok(rc as usize);
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) => return Ok(0),
                Some(libc::EINTR) => continue,
                // An ICMP error queued on the socket (IP_RECVERR is off, so rare): nothing to read.
                Some(libc::ECONNREFUSED) => return Ok(0),
                _ => return Err(PortError::io("recvmmsg on the UDP socket", e)),
            }
        }
    }

    /// Hands the kernel the queued datagrams until it takes them all or has no room.
    fn flush_pending(&mut self) {
        // SAFETY: mmsghdr and iovec are plain old data; all-zero is valid.
        let mut hdrs: [libc::mmsghdr; BATCH] = unsafe { core::mem::zeroed() };
        // SAFETY: as above.
        let mut iovs: [libc::iovec; BATCH] = unsafe { core::mem::zeroed() };
        let base = self.tx_buf.as_mut_ptr();
        while self.pending_head < self.pending.len() {
            let n = (self.pending.len() - self.pending_head).min(BATCH);
            for i in 0..n {
                let p = &mut self.pending[self.pending_head + i];
                // SAFETY: p.slot < BATCH and p.len <= mtu, so the payload lies inside tx_buf.
                let payload = unsafe { base.add(p.slot * self.stride + HEADER_LEN) };
                iovs[i] = libc::iovec { iov_base: payload.cast(), iov_len: p.len };
                let h = &mut hdrs[i];
                h.msg_hdr.msg_name = &mut p.to.storage as *mut _ as *mut libc::c_void;
                h.msg_hdr.msg_namelen = p.to.len;
                h.msg_hdr.msg_iov = &mut iovs[i];
                h.msg_hdr.msg_iovlen = 1;
            }
            // SAFETY: hdrs[..n] point at live iovecs and addresses (in `pending`, which is not
            // touched during the call) and at payloads inside tx_buf.
            let rc = unsafe {
                libc::sendmmsg(
                    self.socket.as_raw_fd(),
                    hdrs.as_mut_ptr(),
                    n as libc::c_uint,
                    libc::MSG_DONTWAIT,
                )
            };
            if rc > 0 {
                self.pending_head += rc as usize;
                continue;
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                // No room in the socket or device queue: keep the rest for the next call.
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) => break,
                _ => {
                    // This datagram cannot go (no route, refused broadcast, too big for the
                    // path): drop it and go on with the others.
                    self.counters.tx_dropped += 1;
                    self.last_tx_error = Some(e);
                    self.pending_head += 1;
                }
            }
        }
        if self.pending_head == self.pending.len() {
            self.pending.clear();
            self.pending_head = 0;
        }
    }
}

impl AsRawFd for UdpPort {
    /// The UDP socket, for callers that multiplex ports in their own epoll set.
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.socket.as_raw_fd()
    }
}

impl Port for UdpPort {
    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> Result<usize> {
        if self.has_pending() {
            self.flush_pending();
        }
        // SAFETY: mmsghdr is plain old data; all-zero is valid.
        let mut hdrs: [libc::mmsghdr; BATCH] = unsafe { core::mem::zeroed() };
        let mut delivered = 0;
        // A flood of junk must not keep us here forever: at most this many batches per call.
        let mut batches_left = max.div_ceil(BATCH) + 4;
        while delivered < max && batches_left > 0 {
            batches_left -= 1;
            let want = (max - delivered).min(BATCH);
            let got = self.receive_batch(want, &mut hdrs)?;
            for (i, h) in hdrs.iter().enumerate().take(got) {
                let len = h.msg_len as usize;
                if h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0 || len > self.mtu {
                    self.counters.rx_dropped += 1;
                    continue;
                }
                let Some(from) = socket_addr_from_raw(&self.rx_names[i], h.msg_hdr.msg_namelen) else {
                    self.counters.rx_dropped += 1;
                    continue;
                };
                let src = match self.by_addr.get(&from) {
                    Some(mac) => *mac,
                    None => {
                        let mac = derived_mac(from);
                        if !self.learn
                            || self.learned >= MAX_LEARNED_PEERS
                            || self.add_peer(mac, from).is_err()
                        {
                            self.unknown_senders += 1;
                            self.counters.rx_dropped += 1;
                            continue;
                        }
                        self.learned += 1;
                        mac
                    }
                };
                let frame = &mut self.rx_buf[i * self.stride..i * self.stride + HEADER_LEN + len];
                frame[0..6].copy_from_slice(&self.mac.0);
                frame[6..12].copy_from_slice(&src.0);
                frame[12..14].copy_from_slice(&EtherType::LANBUS_RAW.to_be_bytes());
                if check_frame(frame, self.mtu).is_err() {
                    self.counters.rx_dropped += 1;
                    continue;
                }
                self.counters.rx_frames += 1;
                self.counters.rx_bytes += frame.len() as u64;
                delivered += 1;
                on_frame(frame);
            }
            if got < want {
                break;
            }
        }
        Ok(delivered)
    }

    fn tx_burst(&mut self, max: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> Result<usize> {
        if self.has_pending() {
            self.flush_pending();
            if self.has_pending() {
                return Ok(0);
            }
        }
        let mut offered = 0;
        let mut accepted = 0;
        let mut exhausted = false;
        while offered < max && !exhausted {
            // Slots are free: the queue is empty whenever a new batch starts.
            let mut slot = 0;
            while slot < BATCH && offered < max {
                let buf = &mut self.tx_buf[slot * self.stride..(slot + 1) * self.stride];
                let Some(len) = fill(buf) else {
                    exhausted = true;
                    break;
                };
                offered += 1;
                if len > buf.len() || check_tx_frame(&buf[..len], self.mtu).is_err() {
                    self.counters.tx_dropped += 1;
                    continue;
                }
                let dst = MacAddr(buf[0..6].try_into().expect("6-byte range"));
                let payload_len = len - HEADER_LEN;
                if dst.is_multicast() {
                    for to in &self.fan_out {
                        self.pending.push(Pending { slot, len: payload_len, to: *to });
                    }
                } else if let Some(to) = self.by_mac.get(&dst) {
                    self.pending.push(Pending { slot, len: payload_len, to: *to });
                } else {
                    self.unknown_destinations += 1;
                    self.counters.tx_dropped += 1;
                    continue;
                }
                self.counters.tx_frames += 1;
                self.counters.tx_bytes += len as u64;
                accepted += 1;
                slot += 1;
            }
            self.flush_pending();
            if self.has_pending() {
                break;
            }
        }
        Ok(accepted)
    }

    fn readiness_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.as_raw_fd())
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<()> {
        // With datagrams still queued, room in the socket is also a reason to wake up.
        poll_ready(self.socket.as_raw_fd(), self.has_pending(), timeout)
    }

    fn mtu(&self) -> usize {
        self.mtu
    }

    fn mac(&self) -> MacAddr {
        self.mac
    }

    fn counters(&self) -> PortCounters {
        self.counters
    }
}

/// Blocks in ppoll(2) until `fd` is readable (or writable, if `writable` is set) or `timeout`
/// passes; EINTR counts as a wake-up.
pub(crate) fn poll_ready(fd: libc::c_int, writable: bool, timeout: Option<Duration>) -> Result<()> {
    let events = if writable { libc::POLLIN | libc::POLLOUT } else { libc::POLLIN };
    let mut pfd = libc::pollfd { fd, events, revents: 0 };
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(t.subsec_nanos() as i32),
    });
    let ts_ptr = ts.as_ref().map_or(core::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: pfd and the optional timespec are live for the call; a null sigmask keeps ours.
    let rc = unsafe { libc::ppoll(&mut pfd, 1, ts_ptr, core::ptr::null()) };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(PortError::io("ppoll on the port's socket", e));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_spec_grammar() {
        let c = UdpConfig::parse(
            "127.0.0.1:7000,peer=127.0.0.1:7001,peer=02:00:00:00:00:09@127.0.0.1:7002,mtu=9000,learn",
        )
        .unwrap();
        assert_eq!(c.bind, "127.0.0.1:7000".parse().unwrap());
        assert_eq!(c.peers.len(), 2);
        assert_eq!(c.peers[0].mac, derived_mac("127.0.0.1:7001".parse().unwrap()));
        assert_eq!(c.peers[1].mac, "02:00:00:00:00:09".parse().unwrap());
        assert_eq!(c.mtu, Some(9000));
        assert!(c.learn);
        let c = UdpConfig::parse("[::1]:7000,peer=[::1]:7001,mac=02:00:00:00:00:01").unwrap();
        assert_eq!(c.mac, Some("02:00:00:00:00:01".parse().unwrap()));
        let c = UdpConfig::parse("0.0.0.0:7000,mac=02:00:00:00:00:01,bcast=10.0.0.255:7000").unwrap();
        assert_eq!(c.broadcast, Some("10.0.0.255:7000".parse().unwrap()));
    }

    #[test]
    fn rejects_bad_specs_with_reasons() {
        let cases = [
            ("", "expected udp:BIND_IP:PORT"),
            ("localhost:7000", "not IP:PORT"),
            ("127.0.0.1", "not IP:PORT"),
            ("0.0.0.0:7000", "unspecified"),
            ("127.0.0.1:7000,peer=[::1]:7001", "different IP versions"),
            ("127.0.0.1:7000,peer=127.0.0.1:7000", "own address"),
            ("127.0.0.1:7000,peer=127.0.0.1:7001,peer=127.0.0.1:7001", "share a MAC or an address"),
            ("127.0.0.1:7000,peer=zz@127.0.0.1:7001", "not a MAC address"),
            ("127.0.0.1:7000,mac=01:00:5e:00:00:01", "multicast"),
            ("127.0.0.1:7000,mtu=70000", "out of range"),
            ("127.0.0.1:7000,mtu=big", "not a number"),
            ("127.0.0.1:7000,bogus=1", "unknown option"),
            ("[::1]:7000,bcast=[::1]:7001", "IPv4"),
        ];
        for (args, want) in cases {
            let err = UdpConfig::parse(args).expect_err(args);
            assert!(err.contains(want), "{args:?}: {err}");
        }
    }

    #[test]
    fn derived_macs_are_local_unicast_and_distinct() {
        let a = derived_mac("127.0.0.1:7000".parse().unwrap());
        let b = derived_mac("127.0.0.1:7001".parse().unwrap());
        assert_ne!(a, b);
        for m in [a, b] {
            assert_eq!(m.0[0], 0x02);
            assert!(!m.is_multicast());
        }
        assert_eq!(a, derived_mac("127.0.0.1:7000".parse().unwrap()));
    }

    #[test]
    fn raw_addresses_round_trip() {
        for s in ["127.0.0.1:7000", "10.1.2.3:1", "[::1]:7000", "[fd00::2]:65535"] {
            let addr: SocketAddr = s.parse().unwrap();
            let raw = RawAddr::new(addr);
            assert_eq!(socket_addr_from_raw(&raw.storage, raw.len), Some(addr));
        }
    }
}
