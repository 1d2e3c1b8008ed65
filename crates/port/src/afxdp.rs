//! The `afxdp` port: lanbus frames through an AF_XDP socket, steered to it by a small XDP
//! program that the port loads and attaches itself.
//!
//! Layer: ports. Spec: `afxdp:IFACE[:QUEUE][,xdp=auto|native|generic][,tx=auto|ring]`.
//! Opening the port on an interface and receive queue:
//!
//! 1. creates an XSKMAP and loads the redirect program ([`bpf::lanbus_redirect_program`]): frames
//!    with EtherType 0x88B5 go to the socket registered for their receive queue, everything else
//!    (ARP, IP, other queues) goes to the kernel as before;
//! 2. attaches it through a BPF link ([`netlink`] `RTM_SETLINK` on kernels without XDP links) in
//!    native (driver) mode, falling back to generic (SKB) mode when the driver has no XDP (on
//!    veth generic first: [`prefers_generic`]); it never replaces a program already on the
//!    interface;
//! 3. creates the AF_XDP socket ([`xsk::Xsk`]): UMEM, fill/completion/rx/tx rings, bound with
//!    need-wakeup, zero-copy if the driver offers it, copy mode otherwise;
//! 4. puts the socket into the map at the queue index.
//!
//! Dropping the port closes the socket and detaches the program; so does the process dying,
//! since the attachment lives on a BPF link file descriptor.
//!
//! Invariants: receive is zero-copy (the callback borrows the frame in UMEM, which goes back to
//! the fill ring after the callback returns); transmit fills UMEM frames in place. Frames larger
//! than one UMEM frame (an MTU above 3826 with 4 KiB frames, say jumbo frames of 9000) take a
//! chain of them (multi-buffer AF_XDP, Linux 6.6+; the program is loaded as able to see such
//! frames, which lets a veth take the MTU): the port then gathers a received chain into one
//! buffer, and fills a frame to send in place across a slot of consecutive UMEM frames that it
//! sends as a chain. A port is one
//! socket on one queue; a second port on the same interface fails (one XDP program per
//! interface), with a message saying so.
//!
//! Queues: frames reach the socket only on its own receive queue (others pass to the kernel).
//! NICs hash non-IP frames like lanbus's to queue 0, so open queue 0, or steer EtherType 0x88B5
//! to the chosen queue (`ethtool -N IFACE flow-type ether proto 0x88b5 action QUEUE`).
//!
//! Veth (as seen on Linux 6.18): native XDP on a veth runs on the frames its peer transmits. Attaching
//! the program switches on NAPI for the veth and turns off the peer's TSO (`ethtool -k PEER`
//! shows `tcp-segmentation-offload: off` while attached), so every frame takes that path: no
//! program, GRO or other setting is needed on the peer, which the tests check by sending from a
//! plain AF_PACKET socket on a peer without XDP. Veth has no zero-copy: sockets bind in copy mode.

pub mod bpf;
pub mod netlink;
pub mod xsk;

use core::time::Duration;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use lanbus_wire::MacAddr;

use crate::{Port, PortCounters, PortError, Result};

pub use bpf::XdpMode;
pub use xsk::BindMode;

/// Which XDP attach mode to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum XdpModeRequest {
    /// Native if the driver supports it, generic otherwise; but generic first on veth, where
    /// it is the faster of the two for frames from the peer's stack or AF_XDP socket (see
    /// [`prefers_generic`]).
    #[default]
    Auto,
    /// Native only (fail if the driver cannot).
    Native,
    /// Generic (SKB) only.
    Generic,
}

/// How to attach the XDP program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttachRequest {
    /// A BPF link (Linux 5.9+), falling back to rtnetlink when the kernel has no XDP links.
    #[default]
    Auto,
    /// A BPF link only: detached when the last file descriptor closes, even if the process dies.
    Link,
    /// rtnetlink only (`RTM_SETLINK`, `IFLA_XDP`): works on older kernels, but the program stays
    /// if the process dies without dropping the port.
    Netlink,
}

/// How the program is attached: each variant detaches on drop.
#[derive(Debug)]
enum Attachment {
    Link(bpf::XdpLink),
    Netlink(netlink::NetlinkXdp),
}

impl Attachment {
    fn mode(&self) -> XdpMode {
        match self {
            Attachment::Link(l) => l.mode(),
            Attachment::Netlink(n) => n.mode(),
        }
    }
}

/// Whether to try zero-copy binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BindRequest {
    /// Zero-copy if the driver supports it, copy mode otherwise.
    #[default]
    Auto,
    /// Copy mode only.
    Copy,
}

/// How frames are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TxRequest {
    /// In copy mode, a burst of one frame goes out through a plain `AF_PACKET` socket, which
    /// costs the kernel less than AF_XDP's copy-mode transmit; longer bursts, and every frame in
    /// zero-copy mode or with busy polling, through the tx ring.
    #[default]
    Auto,
    /// Every frame through the tx ring.
    Ring,
}

/// Busy-polling settings (`SO_PREFER_BUSY_POLL`, `SO_BUSY_POLL`, `SO_BUSY_POLL_BUDGET`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusyPoll {
    /// How long a system call on the socket may spin on the device queue, in microseconds.
    pub usecs: u32,
    /// Frames processed per busy-poll round.
    pub budget: u32,
}

/// How to open an AF_XDP port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AfXdpOptions {
    /// Frames in the UMEM (power of two; half receive, half transmit).
    pub frame_count: u32,
    /// Bytes per UMEM frame: 2048 or 4096. A frame holds `mtu + 14` bytes after the kernel's
    /// 256-byte receive headroom, or takes a chain of up to 17 of them (then each half of
    /// `frame_count` must hold at least four chains).
    pub frame_size: u32,
    /// Entries in each of the four rings (power of two).
    pub ring_size: u32,
    /// XDP attach mode.
    pub xdp_mode: XdpModeRequest,
    /// XDP attach mechanism.
    pub attach: AttachRequest,
    /// Socket bind mode.
    pub bind: BindRequest,
    /// Busy polling on the socket; `None` leaves the system default (off).
    pub busy_poll: Option<BusyPoll>,
    /// How frames are sent.
    pub tx: TxRequest,
}

impl Default for AfXdpOptions {
    fn default() -> Self {
        AfXdpOptions {
            frame_count: 4096,
            frame_size: 4096,
            ring_size: 2048,
            xdp_mode: XdpModeRequest::Auto,
            attach: AttachRequest::Auto,
            bind: BindRequest::Auto,
            busy_poll: None,
            tx: TxRequest::Auto,
        }
    }
}

/// An open AF_XDP port. See the module docs.
#[derive(Debug)]
pub struct AfXdpPort {
    // Field order is drop order: the socket goes first, then the program is detached.
    xsk: xsk::Xsk,
    attachment: Attachment,
    map: OwnedFd,
    prog: OwnedFd,
    ifname: String,
    queue: u32,
    mtu: usize,
    mac: MacAddr,
    counters: PortCounters,
}

/// Most UMEM frames one frame may take: a conservative bound (copy-mode transmit takes
/// `MAX_SKB_FRAGS` + 1 descriptors, at least 18; receive has no limit).
const MAX_CHAIN: usize = 17;

/// Most UMEM frames per frame for which a multi-buffer socket tries zero-copy: a driver's own
/// limit (`NETDEV_A_DEV_XDP_ZC_MAX_SEGS`, 5 for Intel's) is not queried, and beyond it the
/// kernel would never complete the descriptors.
const MAX_ZERO_COPY_CHAIN: usize = 5;

/// Chains' worth of UMEM frames each half (receive, transmit) must hold at least.
const MIN_CHAINS: usize = 4;

const NEEDS_ROOT: &str = "needs root (CAP_NET_ADMIN, CAP_BPF; CAP_SYS_ADMIN on kernels before 5.8): \
                          run as root or grant the capabilities (setcap cap_net_admin,cap_bpf+ep)";

/// Opens an AF_XDP port on `ifname`, receive queue `queue`, in the calling thread's network
/// namespace. Needs root (or CAP_NET_ADMIN and CAP_BPF) and AF_XDP with need-wakeup (Linux 5.4+;
/// 5.9+ attaches through a BPF link, older kernels through rtnetlink).
pub fn open(ifname: &str, queue: u32, options: &AfXdpOptions) -> Result<AfXdpPort> {
    let spec = format!("afxdp:{ifname}:{queue}");
    let unavailable = |why: String| PortError::Unavailable { spec: spec.clone(), why };
    let o = options;
    let geometry_ok = o.frame_count.is_power_of_two()
        && o.frame_count >= 2
        && matches!(o.frame_size, 2048 | 4096)
        && o.ring_size.is_power_of_two()
        && o.ring_size >= o.frame_count / 2;
    if !geometry_ok {
        return Err(PortError::Misuse(format!(
            "AF_XDP options {o:?}: frame_count and ring_size must be powers of two with ring_size >= \
             frame_count / 2, and frame_size 2048 or 4096"
        )));
    }

    let facts = InterfaceFacts::query(ifname).map_err(|e| match e.raw_os_error() {
        Some(libc::ENODEV) => unavailable(format!(
            "no interface {ifname:?} in this network namespace (list them with `ip link`)"
        )),
        _ => PortError::io("reading the interface's MTU and MAC (SIOCGIFMTU, SIOCGIFHWADDR)", e),
    })?;
    // A frame larger than one UMEM frame takes several (multi-buffer AF_XDP, Linux 6.6+), up to
    // the kernel's limit of 17 per frame.
    let room = (o.frame_size - xsk::XDP_PACKET_HEADROOM) as usize;
    let frame = facts.mtu + lanbus_wire::ethernet::HEADER_LEN;
    let multi_buffer = frame > room;
    if frame > MAX_CHAIN * room {
        return Err(unavailable(format!(
            "{ifname} has MTU {} but a frame may take at most {MAX_CHAIN} UMEM frames of {} bytes; \
             lower the MTU (ip link set dev {ifname} mtu 9000)",
            facts.mtu, o.frame_size
        )));
    }
    let chain = frame.div_ceil(room);
    if multi_buffer && (o.frame_count as usize / 2) < MIN_CHAINS * chain {
        return Err(PortError::Misuse(format!(
            "AF_XDP options {o:?}: {ifname}'s MTU {} takes {chain} UMEM frames per frame, so each half \
             of the UMEM (receive, transmit) needs at least {} frames; raise frame_count",
            facts.mtu,
            MIN_CHAINS * chain
        )));
    }
    let needs_multi_buffer = || {
        unavailable(format!(
            "{ifname} has MTU {}, more than a {}-byte UMEM frame holds ({room} bytes of frame): that \
             needs multi-buffer AF_XDP (Linux 6.6+); lower the MTU (ip link set dev {ifname} mtu 1500)",
            facts.mtu, o.frame_size
        ))
    };

    let classify = |op: &'static str, e: io::Error| match e.raw_os_error() {
        Some(libc::EPERM | libc::EACCES) => unavailable(NEEDS_ROOT.to_string()),
        Some(libc::ENOSYS) => {
            unavailable(format!("{op}: this kernel has no bpf() system call (CONFIG_BPF_SYSCALL)"))
        }
        _ => PortError::io(op, e),
    };

    let map = bpf::create_xskmap(queue.saturating_add(1).max(64)).map_err(|e| match e.raw_os_error() {
        Some(libc::EINVAL) => unavailable(
            "this kernel has no XSKMAP: AF_XDP needs Linux 4.18+ built with CONFIG_XDP_SOCKETS".to_string(),
        ),
        _ => classify("bpf(BPF_MAP_CREATE, XSKMAP)", e),
    })?;
    let insns = bpf::lanbus_redirect_program(map.as_raw_fd());
    let prog = bpf::load_xdp_program(&insns, "lanbus_xdp", multi_buffer).map_err(|e| {
        match e.source.raw_os_error() {
            Some(libc::EPERM | libc::EACCES) if e.log.is_empty() => unavailable(NEEDS_ROOT.to_string()),
            Some(libc::EINVAL) if multi_buffer && e.log.is_empty() => needs_multi_buffer(),
            _ => PortError::io(
                "bpf(BPF_PROG_LOAD) of the lanbus XDP program",
                io::Error::new(e.source.kind(), format!("{}; verifier log:\n{}", e.source, e.log)),
            ),
        }
    })?;

    let attachment =
        attach(facts.ifindex, facts.driver.as_deref(), &prog, o).map_err(|(e, kernel_says)| {
            let says =
                if kernel_says.is_empty() { String::new() } else { format!(" (kernel: {kernel_says})") };
            match e.raw_os_error() {
                Some(libc::EBUSY | libc::EEXIST) => unavailable(format!(
                    "{ifname} already has an XDP program attached (another lanbus port, or someone else's); \
                 lanbus does not replace it. See it with `ip link show dev {ifname}`; if it is stale, \
                 remove it with `ip link set dev {ifname} xdp off`{says}"
                )),
                Some(libc::EOPNOTSUPP) => unavailable(format!(
                    "the driver of {ifname} has no native XDP: use generic mode (spec option xdp=generic or \
                 xdp=auto, XdpModeRequest::Generic or Auto){says}"
                )),
                Some(libc::EPERM | libc::EACCES) => unavailable(NEEDS_ROOT.to_string()),
                _ => {
                    PortError::io("attaching the XDP program", io::Error::new(e.kind(), format!("{e}{says}")))
                }
            }
        })?;

    let geometry =
        xsk::Geometry { frame_count: o.frame_count, frame_size: o.frame_size, ring_size: o.ring_size };
    let zero_copy = o.bind == BindRequest::Auto && chain <= MAX_ZERO_COPY_CHAIN;
    let mut xsk = xsk::Xsk::create(facts.ifindex, queue, geometry, zero_copy, chain as u32).map_err(
        |(op, e)| match e.raw_os_error() {
            Some(libc::EOPNOTSUPP | libc::EINVAL) if op == "bind" && multi_buffer => unavailable(format!(
                "cannot bind to queue {queue} of {ifname} for frames of {frame} bytes, more than one \
                 {}-byte UMEM frame: that needs multi-buffer AF_XDP (Linux 6.6+; else lower the MTU: \
                 ip link set dev {ifname} mtu 1500), a queue that exists (`ethtool -l {ifname}`) and \
                 an interface that is up",
                o.frame_size
            )),
            Some(libc::EAFNOSUPPORT) => unavailable(
                "this kernel has no AF_XDP sockets (needs CONFIG_XDP_SOCKETS, Linux 4.18+)".to_string(),
            ),
            Some(libc::EINVAL) if op == "bind" => unavailable(format!(
                "cannot bind to queue {queue} of {ifname}: the interface has fewer receive queues (see \
                 `ethtool -l {ifname}`), or it is down"
            )),
            Some(libc::EBUSY) if op == "bind" => {
                unavailable(format!("queue {queue} of {ifname} already has an AF_XDP socket bound to it"))
            }
            Some(libc::ENOMEM | libc::ENOBUFS) => unavailable(format!(
                "{op}: out of locked memory for the UMEM ({} bytes); raise `ulimit -l` or use fewer frames",
                u64::from(o.frame_count) * u64::from(o.frame_size)
            )),
            _ => classify(op, e),
        },
    )?;
    if let Some(b) = o.busy_poll {
        xsk.set_busy_poll(b.usecs, b.budget).map_err(|e| classify("setsockopt(SO_BUSY_POLL)", e))?;
    }
    // With busy polling every transmit stays a kick of this socket, which polls its queue.
    if o.tx == TxRequest::Auto && xsk.bind_mode() == BindMode::Copy && o.busy_poll.is_none() {
        // Where the socket cannot be made (a kernel without AF_PACKET, a security module that
        // refuses it) the ring sends everything.
        if let Some(socket) = crate::afpacket::single_frame_socket(facts.ifindex as libc::c_int, true) {
            xsk.send_lone_frames_through(socket);
        }
    }
    bpf::map_update_u32(&map, queue, xsk.fd().as_raw_fd() as u32)
        .map_err(|e| classify("bpf(BPF_MAP_UPDATE_ELEM) of the socket into the XSKMAP", e))?;

    Ok(AfXdpPort {
        xsk,
        attachment,
        map,
        prog,
        ifname: ifname.to_string(),
        queue,
        mtu: facts.mtu,
        mac: facts.mac,
        counters: PortCounters::default(),
    })
}

/// Whether `Auto` tries generic XDP before native on an interface with this driver: on veth.
///
/// A veth runs a native program on the frames its peer transmits from a NAPI poll that the
/// transmit schedules, after a hop through a ring and a conversion of each skb into an XDP
/// buffer (whose memory is then freed as a page fragment); generic XDP runs the program on the
/// skb in the receive path the transmit already runs. Measured on a veth between two namespaces
/// (copy mode both ways, `port_pingpong` and `port_rate` examples), generic gives the shorter
/// ping-pong round trip and the higher one-way frame rate at every frame size tried; in a
/// system-wide profile native mode's extra work shows as `page_frag_free` and `veth_poll`. Native stays the
/// better mode on a veth that receives frames redirected by another device's XDP program; ask
/// for it then.
pub fn prefers_generic(driver: Option<&str>) -> bool {
    driver == Some("veth")
}

/// Attaches `prog` to `ifindex` as the options ask; on failure, the kernel's error and its
/// explanation (if any). In `Auto` XDP mode: native first, generic when the driver cannot (on
/// veth generic first, see [`prefers_generic`]); an interface that already has a program is
/// reported, never worked around.
fn attach(
    ifindex: u32,
    driver: Option<&str>,
    prog: &OwnedFd,
    o: &AfXdpOptions,
) -> core::result::Result<Attachment, (io::Error, String)> {
    let by_link = |mode| {
        bpf::XdpLink::attach(prog, ifindex, mode).map(Attachment::Link).map_err(|e| (e, String::new()))
    };
    let by_netlink = |mode| {
        netlink::NetlinkXdp::attach(prog, ifindex, mode)
            .map(Attachment::Netlink)
            .map_err(|e| (e.source, e.message))
    };
    let in_mode = |mode| match o.attach {
        AttachRequest::Link => by_link(mode),
        AttachRequest::Netlink => by_netlink(mode),
        // Kernels before 5.9 do not know BPF_XDP links and say EINVAL.
        AttachRequest::Auto => match by_link(mode) {
            Err((e, _)) if e.raw_os_error() == Some(libc::EINVAL) => by_netlink(mode),
            other => other,
        },
    };
    let fatal = |e: &io::Error| {
        matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EEXIST | libc::EPERM | libc::EACCES))
    };
    match o.xdp_mode {
        XdpModeRequest::Native => in_mode(XdpMode::Native),
        XdpModeRequest::Generic => in_mode(XdpMode::Generic),
        // If native fails too, generic's error is the one to report.
        XdpModeRequest::Auto if prefers_generic(driver) => match in_mode(XdpMode::Generic) {
            Err((e, says)) if fatal(&e) => Err((e, says)),
            Err(first) => in_mode(XdpMode::Native).map_err(|_| first),
            ok => ok,
        },
        XdpModeRequest::Auto => match in_mode(XdpMode::Native) {
            Err((e, says)) if fatal(&e) => Err((e, says)),
            Err(_) => in_mode(XdpMode::Generic),
            ok => ok,
        },
    }
}

impl AfXdpPort {
    /// Where the XDP program runs.
    pub fn xdp_mode(&self) -> XdpMode {
        self.attachment.mode()
    }

    /// How the socket is bound (zero-copy or copy).
    pub fn bind_mode(&self) -> BindMode {
        self.xsk.bind_mode()
    }

    /// The interface name.
    pub fn ifname(&self) -> &str {
        &self.ifname
    }

    /// Frames sent through the plain `AF_PACKET` socket rather than the tx ring (see
    /// [`TxRequest::Auto`]).
    pub fn lone_frames_sent(&self) -> u64 {
        self.xsk.lone_frames
    }

    /// The receive queue.
    pub fn queue(&self) -> u32 {
        self.queue
    }

    /// Runs the port's XDP program once on `frame` in the kernel and returns its verdict
    /// ([`bpf::action`]), as if the frame arrived on receive queue 0 (a diagnostic; needs root).
    pub fn test_program(&self, frame: &[u8]) -> Result<u32> {
        bpf::test_run_xdp(&self.prog, frame).map_err(|e| PortError::io("bpf(BPF_PROG_TEST_RUN)", e))
    }

    /// The XSKMAP (queue index to socket) the program redirects into.
    pub fn xsks_map(&self) -> &OwnedFd {
        &self.map
    }

    /// The kernel's own counters for this socket (`XDP_STATISTICS`).
    pub fn kernel_statistics(&self) -> Result<libc::xdp_statistics> {
        self.xsk.statistics().map_err(|e| PortError::io("getsockopt(XDP_STATISTICS)", e))
    }
}

impl Port for AfXdpPort {
    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> Result<usize> {
        let max = u32::try_from(max).unwrap_or(u32::MAX);
        let (n, bytes) = self.xsk.rx_burst(max, on_frame).map_err(|e| PortError::io("AF_XDP receive", e))?;
        self.counters.rx_frames += u64::from(n);
        self.counters.rx_bytes += bytes;
        Ok(n as usize)
    }

    fn tx_burst(&mut self, max: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> Result<usize> {
        let max = u32::try_from(max).unwrap_or(u32::MAX);
        let capacity = self.frame_capacity();
        let (n, bytes, bad) = self
            .xsk
            .tx_burst(max, capacity, fill)
            .map_err(|e| PortError::io("AF_XDP transmit (sendto kick)", e))?;
        self.counters.tx_frames += u64::from(n);
        self.counters.tx_bytes += bytes;
        self.counters.tx_dropped += bad;
        Ok(n as usize)
    }

    fn readiness_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        Some(self.xsk.fd().as_raw_fd())
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<()> {
        if self.xsk.rx_ready() {
            return Ok(());
        }
        let ms = match timeout {
            None => -1,
            // Round up so a short timeout still sleeps instead of spinning.
            Some(t) => i32::try_from(t.as_nanos().div_ceil(1_000_000)).unwrap_or(i32::MAX),
        };
        let mut pfd = libc::pollfd { fd: self.xsk.fd().as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the duration of the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(PortError::io("poll on the AF_XDP socket", e));
            }
        }
        Ok(())
    }

    fn mtu(&self) -> usize {
        self.mtu
    }

    fn mac(&self) -> MacAddr {
        self.mac
    }

    fn counters(&self) -> PortCounters {
        let mut c = self.counters;
        c.rx_dropped += self.xsk.bad_descs;
        // Frames the kernel dropped for this socket: rx ring full, no fill buffer, bad descriptors.
        if let Ok(st) = self.xsk.statistics() {
            c.rx_dropped += st.rx_dropped + st.rx_ring_full + st.rx_invalid_descs;
            c.tx_dropped += st.tx_invalid_descs;
        }
        c
    }
}

/// Index, MTU and MAC of an interface in the calling thread's namespace.
#[derive(Debug, Clone)]
struct InterfaceFacts {
    ifindex: u32,
    mtu: usize,
    mac: MacAddr,
    /// The driver's name (`ethtool -i`), if it says.
    driver: Option<String>,
}

/// `SIOCETHTOOL` request `ETHTOOL_GDRVINFO` (include/uapi/linux/ethtool.h).
const ETHTOOL_GDRVINFO: u32 = 0x3;
/// Size of `struct ethtool_drvinfo`; the driver's name is bytes 4..36.
const ETHTOOL_DRVINFO_LEN: usize = 196;

/// `struct ifreq`: a name and a 24-byte union.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    data: [u8; 24],
}

impl InterfaceFacts {
    fn query(ifname: &str) -> io::Result<InterfaceFacts> {
        if ifname.is_empty() || ifname.len() >= libc::IFNAMSIZ || ifname.contains(['/', '\0', ' ']) {
            return Err(io::Error::from_raw_os_error(libc::ENODEV));
        }
        // Any socket of this namespace answers interface ioctls.
        // SAFETY: plain socket(2) call.
        let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(raw) };
        let ioctl = |request: libc::c_ulong| -> io::Result<IfReq> {
            let mut req = IfReq { name: [0; libc::IFNAMSIZ], data: [0; 24] };
            req.name[..ifname.len()].copy_from_slice(ifname.as_bytes());
            // SAFETY: `req` is a live ifreq; these requests read the name and write the union.
            let rc = unsafe { libc::ioctl(sock.as_raw_fd(), request as _, &raw mut req) };
            if rc < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(req)
        };
        let index = ioctl(libc::SIOCGIFINDEX)?;
        let mtu = ioctl(libc::SIOCGIFMTU)?;
        let hw = ioctl(libc::SIOCGIFHWADDR)?;
        let ifindex = i32::from_ne_bytes(index.data[..4].try_into().expect("4 bytes")) as u32;
        let mtu = i32::from_ne_bytes(mtu.data[..4].try_into().expect("4 bytes"));
        // ifr_hwaddr is a struct sockaddr: a 2-byte family, then the address.
        let mac = MacAddr(hw.data[2..8].try_into().expect("6 bytes"));
        let mut info = [0u8; ETHTOOL_DRVINFO_LEN];
        info[..4].copy_from_slice(&ETHTOOL_GDRVINFO.to_ne_bytes());
        let mut req = IfReq { name: [0; libc::IFNAMSIZ], data: [0; 24] };
        req.name[..ifname.len()].copy_from_slice(ifname.as_bytes());
        // ifr_data: a pointer to the ethtool request.
        const PTR: usize = core::mem::size_of::<usize>();
        req.data[..PTR].copy_from_slice(&(info.as_mut_ptr() as usize).to_ne_bytes());
        // SAFETY: `req` is a live ifreq whose ifr_data points to `info`, a live buffer the size
        // of struct ethtool_drvinfo, which the kernel fills.
        let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCETHTOOL as _, &raw mut req) };
        let driver = (rc == 0).then(|| {
            let name = &info[4..36];
            let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
            String::from_utf8_lossy(&name[..end]).into_owned()
        });
        Ok(InterfaceFacts { ifindex, mtu: usize::try_from(mtu).unwrap_or(0), mac, driver })
    }
}

#[cfg(test)]
mod tests;
