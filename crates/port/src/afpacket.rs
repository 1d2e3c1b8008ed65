//! The `afpacket` port: raw Ethernet through an AF_PACKET socket with PACKET_MMAP rings.
//!
//! Layer: ports. One `AF_PACKET`/`SOCK_RAW` socket bound to one interface and to EtherType 0x88B5,
//! with (Linux `Documentation/networking/packet_mmap.rst`):
//!
//! - a receive ring: TPACKET_V2 by default (a slot per frame, each handed over as soon as the
//!   kernel has written it), or with `rx=v3` TPACKET_V3 (blocks of packets that the kernel hands
//!   over whole, when full or after `tov_ms` when partly filled); the port walks a block (a V2 slot
//!   is a block of one), lends each frame to the caller straight from the mapping, and gives the
//!   block back;
//! - a mapped transmit ring (the same version's frame layout, one frame per slot): the caller writes the
//!   frame into the slot, the port marks it `TP_STATUS_SEND_REQUEST` and kicks the kernel with a
//!   non-blocking `send`; `PACKET_LOSS` makes the kernel skip a malformed slot rather than stall;
//! - a second socket, bound to the interface with protocol 0 (it receives nothing) and without a
//!   ring, for the first frame of each burst: a plain `send` of a frame is one copy into an skb,
//!   where a ring slot costs the kernel a walk of the ring, a page reference per frame and a
//!   destructor that hands the slot back (raw ping-pong on a veth, `port_pingpong`: the plain
//!   `send` gives the shorter round trip). The rest of a burst goes through the ring behind it; with the
//!   qdisc bypassed both reach the driver within the system call, in order. A socket that cannot
//!   be made leaves every frame to the ring;
//! - `PACKET_QDISC_BYPASS` (frames go straight to the driver), `PACKET_IGNORE_OUTGOING` where the
//!   kernel has it (Linux 4.20+; otherwise outgoing frames are recognised by `sll_pkttype` and
//!   skipped), and a classic BPF filter (`SO_ATTACH_FILTER`: accept only EtherType 0x88B5) on top
//!   of the protocol binding, so nothing else is copied into the ring.
//!
//! Invariants: the port trusts nothing in the ring: every offset and length the kernel wrote is
//! checked against the block before it is used, and a block that does not add up is given back
//! and its remaining frames counted as dropped. Frames that are too short, too long (or cut by
//! the ring) or of another EtherType are counted in `rx_dropped` and never delivered; so are the
//! kernel's own ring-full drops (`PACKET_STATISTICS`). The port owns its mapping exclusively;
//! ownership of each block and slot passes between the port and the kernel only through its status
//! word, read with Acquire and written with Release.
//!
//! Why V2 is the default: a TPACKET_V3 block becomes the port's (`TP_STATUS_USER`) only when the
//! kernel closes it, in `prb_close_block`, called when the next packet does not fit
//! (`prb_retire_current_block` from `tpacket_rcv`) or from the retire timer
//! (`prb_retire_rx_blk_timer_expired`, every `tp_retire_blk_tov` ms converted to jiffies, so at
//! least 1 ms and a jiffy). Nothing user space can do closes a block early: poll(2) only reports
//! blocks already closed, and reading the open block would race with the kernel writing it. So a
//! lone frame (a request, a reply, an ACK) waits up to the timeout: on a veth, ping-pong round
//! trips take about the 1 ms timeout, many times sockperf's. V2 hands every frame over at once,
//! at the cost of a status word per frame instead of per block; `rx=v3` remains for receivers that
//! only stream, where blocks fill in microseconds and batching pays.

use core::cell::Cell;
use core::sync::atomic::{AtomicU32, Ordering};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use lanbus_wire::ethernet::HEADER_LEN;
use lanbus_wire::{EtherType, MacAddr};

use crate::cache::{prefetch, prefetch_lines};
use crate::check::check_frame;
use crate::udp::poll_ready;
use crate::{Port, PortCounters, PortError, Result};

/// Bytes of `struct tpacket3_hdr` rounded to TPACKET_ALIGNMENT: where `sockaddr_ll` follows the
/// frame header in a receive slot, and where the frame data starts in a transmit slot.
const TPACKET3_HDR_ALIGNED: usize = 48;
/// `TPACKET3_HDRLEN`: the aligned header plus `sockaddr_ll`.
const TPACKET3_HDRLEN: usize = TPACKET3_HDR_ALIGNED + core::mem::size_of::<libc::sockaddr_ll>();

// Offsets in `struct tpacket_block_desc` (version, offset_to_priv, then tpacket_hdr_v1).
const BLOCK_STATUS: usize = 8;
const BLOCK_NUM_PKTS: usize = 12;
const BLOCK_FIRST_PKT: usize = 16;
/// Size of the block descriptor, rounded as the kernel does (`BLK_HDR_LEN`).
const BLOCK_DESC_LEN: usize = 48;

/// Bytes of `struct tpacket2_hdr` rounded to TPACKET_ALIGNMENT (as above, for TPACKET_V2).
const TPACKET2_HDR_ALIGNED: usize = 32;
/// `TPACKET2_HDRLEN`.
const TPACKET2_HDRLEN: usize = TPACKET2_HDR_ALIGNED + core::mem::size_of::<libc::sockaddr_ll>();
// Offsets in `struct tpacket2_hdr`.
const V2_STATUS: usize = 0;
const V2_LEN: usize = 4;
const V2_SNAPLEN: usize = 8;
const V2_MAC: usize = 12;
const V2_SEC: usize = 16;
const V2_NSEC: usize = 20;
/// `tpacket2_hdr.tp_vlan_tci`, `tp_vlan_tpid`.
const V2_VLAN_TCI: usize = 24;
const V2_VLAN_TPID: usize = 26;

// Offsets in `struct tpacket3_hdr`.
const PKT_NEXT_OFFSET: usize = 0;
const PKT_SEC: usize = 4;
const PKT_NSEC: usize = 8;
const PKT_SNAPLEN: usize = 12;
const PKT_LEN: usize = 16;
const PKT_STATUS: usize = 20;
const PKT_MAC: usize = 24;
/// `tpacket3_hdr.hv1.tp_vlan_tci` (a u32), `tp_vlan_tpid`.
const PKT_VLAN_TCI: usize = 32;
const PKT_VLAN_TPID: usize = 36;
/// `tp_status` bits: the frame had an 802.1Q tag, which the kernel took out of its bytes and
/// put in `tp_vlan_tci` (and its TPID in `tp_vlan_tpid`).
const TP_STATUS_VLAN_VALID: u32 = 1 << 4;
const TP_STATUS_VLAN_TPID_VALID: u32 = 1 << 6;

/// The tag the kernel took off a frame, from a ring header's status and fields: (TPID, TCI).
fn vlan_tag(status: Option<u32>, tci: Option<u16>, tpid: Option<u16>) -> Option<(u16, u16)> {
    let status = status?;
    if status & TP_STATUS_VLAN_VALID == 0 {
        return None;
    }
    let tpid = if status & TP_STATUS_VLAN_TPID_VALID != 0 { tpid? } else { crate::vlan::TPID };
    Some((tpid, tci?))
}
/// Offset of `sll_pkttype` in `sockaddr_ll`.
const SLL_PKTTYPE: usize = 10;

/// Frames per transmit ring.
const TX_FRAMES: usize = 256;
/// Receive ring blocks.
const RX_BLOCKS: usize = 16;
/// Smallest receive block.
const RX_BLOCK_MIN_BYTES: usize = 1 << 18;
/// Bytes a TPACKET_V2 receive ring aims for (within [`RX_V2_MIN_SLOTS`] to 1024 slots).
const RX_V2_BYTES: usize = 4 << 20;
/// Fewest slots of a TPACKET_V2 receive ring: twice the transport's default window (128 frames),
/// so that a receiver a scheduling slice late does not drop a sender's window of the largest
/// frames (at MTU 65000 a slot takes 128 KiB and the bytes alone would give 32 slots).
const RX_V2_MIN_SLOTS: usize = 256;

/// How to open an [`AfPacketPort`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AfPacketConfig {
    /// The interface name (at most 15 bytes).
    pub ifname: String,
    /// Milliseconds the kernel may hold a partly filled receive block (TPACKET_V3 retire timeout).
    pub tov_ms: u32,
    /// Which TPACKET version the rings use.
    pub rx: RxVersion,
    /// Whether every EtherType is received (IPv4, ARP, ...), for a TCP/IP stack on the port;
    /// by default only lanbus frames (EtherType 0x88B5) are.
    pub all_ethertypes: bool,
    /// Whether frames reach the port with their 802.1Q tags (for groups carried as VLANs, see
    /// [`crate::vlan`]). The kernel takes a tag off a frame, and drops it, before it hands the frame
    /// to a socket bound to one EtherType; so the socket then listens to every EtherType (the
    /// filter still admits only lanbus frames, tagged or not) and puts the tag the kernel reports
    /// (`tp_vlan_tci`) back into the frame.
    pub keep_tags: bool,
}

/// The ring layout: TPACKET_V2 (one frame per slot, each handed over at once; the default) or
/// TPACKET_V3 (block-based receive: batches, but a lone frame waits for the block timeout; see
/// the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RxVersion {
    /// TPACKET_V3: blocks of frames, handed over when full or after `tov_ms`.
    V3,
    /// TPACKET_V2: a slot per frame, handed over as soon as it is written.
    #[default]
    V2,
}

impl AfPacketConfig {
    /// Defaults for `ifname`: TPACKET_V2 (and a 1 ms block timeout should `rx` be set to V3).
    pub fn new(ifname: &str) -> Self {
        AfPacketConfig {
            ifname: ifname.to_string(),
            tov_ms: 1,
            rx: RxVersion::V2,
            all_ethertypes: false,
            keep_tags: false,
        }
    }

    /// Parses `IFACE[,rx=v2|v3][,tov_ms=MS][,ethertypes=all][,tags=keep]` (the spec without
    /// `afpacket:`).
    pub fn parse(args: &str) -> core::result::Result<AfPacketConfig, String> {
        let mut parts = args.split(',');
        let ifname = parts.next().unwrap_or("").trim();
        check_ifname(ifname)?;
        let mut config = AfPacketConfig::new(ifname);
        for part in parts {
            match part.trim().split_once('=') {
                Some(("tov_ms", v)) => {
                    config.tov_ms =
                        v.trim().parse().ok().filter(|ms| (1..=1000).contains(ms)).ok_or_else(|| {
                            format!("tov_ms={v:?} is not a number of milliseconds in 1..=1000")
                        })?;
                }
                Some(("rx", v)) => {
                    config.rx = match v.trim() {
                        "v3" => RxVersion::V3,
                        "v2" => RxVersion::V2,
                        other => {
                            return Err(format!(
                                "rx={other:?}: write rx=v2 (frame per slot, the default) or rx=v3 (blocks)"
                            ))
                        }
                    };
                }
                Some(("ethertypes", v)) => {
                    config.all_ethertypes = match v.trim() {
                        "all" => true,
                        "lanbus" => false,
                        other => {
                            return Err(format!(
                                "ethertypes={other:?}: write ethertypes=lanbus (0x88B5 only, the default) or \
                                 ethertypes=all"
                            ))
                        }
                    };
                }
                Some(("tags", v)) => {
                    config.keep_tags = match v.trim() {
                        "keep" => true,
                        other => {
                            return Err(format!("tags={other:?}: write tags=keep (802.1Q tags stay on)"))
                        }
                    };
                }
                _ => {
                    return Err(format!(
                        "unknown option {part:?}; options are rx=v2|v3, tov_ms=MS, ethertypes=lanbus|all and \
                         tags=keep"
                    ))
                }
            }
        }
        Ok(config)
    }
}

/// Checks that `name` can be a Linux interface name; the error says why not.
pub fn check_ifname(name: &str) -> core::result::Result<(), String> {
    if name.is_empty() {
        return Err("expected an interface name, for example afpacket:eth1 (`ip link` lists them)".into());
    }
    if name.len() > 15 {
        return Err(format!("{name:?} is longer than 15 bytes, which no Linux interface name is"));
    }
    if name.contains(['/', ' ', '\0', ',']) {
        return Err(format!("{name:?} is not an interface name (no '/', ',', spaces)"));
    }
    Ok(())
}

/// What an interface looks like, read with ioctls on an ordinary socket (no privileges needed).
struct IfaceInfo {
    index: libc::c_int,
    mac: MacAddr,
    mtu: usize,
}

fn iface_info(spec: &str, ifname: &str) -> Result<IfaceInfo> {
    let unavailable = |why: String| PortError::Unavailable { spec: spec.to_string(), why };
    let cname = CString::new(ifname).map_err(|_| unavailable(format!("{ifname:?} contains a NUL byte")))?;
    // SAFETY: cname is a valid NUL-terminated string for the duration of the call.
    let index = unsafe { libc::if_nametoindex(cname.as_ptr()) };
    if index == 0 {
        return Err(unavailable(format!(
            "no interface named {ifname:?} in this network namespace (`ip link` lists them)"
        )));
    }
    // SAFETY: socket() has no memory preconditions; the result is checked.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(PortError::io("socket(AF_INET) for interface ioctls", std::io::Error::last_os_error()));
    }
    // SAFETY: raw is a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let ioctl = |request: libc::c_ulong, what: &'static str| -> Result<libc::ifreq> {
        // SAFETY: ifreq is plain old data; all-zero is valid.
        let mut req: libc::ifreq = unsafe { core::mem::zeroed() };
        for (dst, src) in req.ifr_name.iter_mut().zip(ifname.bytes()) {
            *dst = src as libc::c_char;
        }
        // SAFETY: the request codes used here read an ifreq whose name is set and write into it;
        // req lives for the call.
        let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, &mut req as *mut libc::ifreq) };
        if rc != 0 {
            return Err(PortError::io(what, std::io::Error::last_os_error()));
        }
        Ok(req)
    };
    let flags_req = ioctl(libc::SIOCGIFFLAGS, "SIOCGIFFLAGS")?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    let flags = i32::from(unsafe { flags_req.ifr_ifru.ifru_flags });
    if flags & libc::IFF_UP == 0 {
        return Err(unavailable(format!(
            "interface {ifname} is down: bring it up with `ip link set {ifname} up`"
        )));
    }
    let hw = ioctl(libc::SIOCGIFHWADDR, "SIOCGIFHWADDR")?;
    // SAFETY: SIOCGIFHWADDR filled the hwaddr member of the union.
    let hwaddr = unsafe { hw.ifr_ifru.ifru_hwaddr };
    if hwaddr.sa_family != libc::ARPHRD_ETHER {
        return Err(unavailable(format!(
            "{ifname} is not an Ethernet interface (hardware type {}); lanbus needs Ethernet (a NIC, veth, \
             bridge or macvlan), or the udp port for other links",
            hwaddr.sa_family
        )));
    }
    let mut mac = [0u8; 6];
    for (d, s) in mac.iter_mut().zip(hwaddr.sa_data.iter()) {
        *d = *s as u8;
    }
    let mtu_req = ioctl(libc::SIOCGIFMTU, "SIOCGIFMTU")?;
    // SAFETY: SIOCGIFMTU filled the mtu member of the union.
    let mtu = unsafe { mtu_req.ifr_ifru.ifru_mtu };
    let mtu = usize::try_from(mtu)
        .ok()
        .filter(|m| *m >= 68)
        .ok_or_else(|| unavailable(format!("{ifname} reports MTU {mtu}")))?;
    Ok(IfaceInfo { index: index as libc::c_int, mac: MacAddr(mac), mtu })
}

/// The ring-less socket single frames go out through: `AF_PACKET`/`SOCK_RAW` bound to interface
/// `ifindex` with protocol 0, so the kernel hands it no frame, and with the qdisc bypassed like
/// the ring's socket (so the two reach the driver in the order they are sent). `None` if it
/// cannot be made: the ring then sends everything. The `afxdp` port sends its lone frames through
/// one too, in copy mode.
pub(crate) fn single_frame_socket(ifindex: libc::c_int, qdisc_bypass: bool) -> Option<OwnedFd> {
    // SAFETY: plain socket(2) call with constant arguments.
    let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return None;
    }
    // SAFETY: raw is a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let one: libc::c_int = 1;
    if qdisc_bypass && set_option(&fd, libc::SOL_PACKET, libc::PACKET_QDISC_BYPASS, &one).is_err() {
        return None;
    }
    // SAFETY: sockaddr_ll is plain old data; all-zero is valid.
    let mut sll: libc::sockaddr_ll = unsafe { core::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_ifindex = ifindex;
    // SAFETY: sll is a valid sockaddr_ll for the call.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
            core::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    (rc == 0).then_some(fd)
}

fn set_option<T>(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, value: &T) -> std::io::Result<()> {
    // SAFETY: the pointer and length describe `value`, which lives for the call; the kernel only
    // reads it.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            value as *const T as *const libc::c_void,
            core::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The classic BPF program: accept a frame only if its EtherType (bytes 12..14) is 0x88B5.
fn lanbus_filter() -> [libc::sock_filter; 4] {
    const BPF_LD_H_ABS: u16 = 0x28;
    const BPF_JMP_JEQ_K: u16 = 0x15;
    const BPF_RET_K: u16 = 0x06;
    [
        libc::sock_filter { code: BPF_LD_H_ABS, jt: 0, jf: 0, k: 12 },
        libc::sock_filter { code: BPF_JMP_JEQ_K, jt: 0, jf: 1, k: u32::from(EtherType::LANBUS_RAW) },
        // Accept the whole frame (the ring cuts it if it is bigger than a block).
        libc::sock_filter { code: BPF_RET_K, jt: 0, jf: 0, k: 0x0004_0000 },
        libc::sock_filter { code: BPF_RET_K, jt: 0, jf: 0, k: 0 },
    ]
}

/// Where the receive walk stands inside the current block.
#[derive(Debug, Clone, Copy)]
struct RxCursor {
    /// Packets of the block not yet looked at.
    left: u32,
    /// Offset of the next packet header in the block.
    offset: usize,
}

fn read_u32(block: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(block.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

fn read_u16(block: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(block.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

impl RxCursor {
    /// The walk of a block the kernel just handed over: its packet count and first offset.
    fn start(block: &[u8]) -> RxCursor {
        match (read_u32(block, BLOCK_NUM_PKTS), read_u32(block, BLOCK_FIRST_PKT)) {
            (Some(left), Some(offset)) => RxCursor { left, offset: offset as usize },
            _ => RxCursor { left: 0, offset: 0 },
        }
    }
}

/// One step of the walk through a receive block.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    /// No packets left: give the block back.
    Done,
    /// The chain of packet headers does not add up; `lost` packets cannot be found.
    Corrupt {
        /// Packets of the block not delivered.
        lost: u32,
    },
    /// This packet's frame lies outside the block.
    Bad,
    /// A packet: the frame's bytes in the block, the length it had on the wire, and whether it
    /// was outgoing (PACKET_OUTGOING).
    Packet {
        /// Byte range of the frame (as captured) in the block.
        frame: core::ops::Range<usize>,
        /// The frame's length on the wire (more than the range if the ring cut it).
        wire_len: usize,
        /// Whether this host sent it.
        outgoing: bool,
        /// When the kernel received it (`tp_sec`, `tp_nsec`), ns since the Unix epoch; 0 if
        /// unset.
        stamp_ns: u64,
        /// The kernel left its transport checksum partial (`TP_STATUS_CSUMNOTREADY`).
        partial_csum: bool,
        /// The 802.1Q tag the kernel took out of the frame's bytes: (TPID, TCI).
        vlan: Option<(u16, u16)>,
    },
}

/// A ring header's receive time, ns since the Unix epoch (0 when missing).
fn stamp_at(buf: &[u8], sec: usize, nsec: usize) -> u64 {
    match (read_u32(buf, sec), read_u32(buf, nsec)) {
        (Some(s), Some(ns)) => u64::from(s) * 1_000_000_000 + u64::from(ns),
        _ => 0,
    }
}

/// Reads the packet at the cursor and moves past it. Trusts nothing in the block: every offset
/// and length is checked against it, offsets must move forward by at least a header, so the walk
/// ends after at most `block.len() / TPACKET3_HDRLEN` steps whatever the bytes say.
fn next_packet(block: &[u8], cursor: &mut RxCursor) -> Step {
    if cursor.left == 0 {
        return Step::Done;
    }
    let at = cursor.offset;
    let header_ok =
        at >= BLOCK_DESC_LEN && at.checked_add(TPACKET3_HDRLEN).is_some_and(|end| end <= block.len());
    let fields = header_ok
        .then(|| {
            Some((
                read_u32(block, at + PKT_NEXT_OFFSET)? as usize,
                read_u32(block, at + PKT_SNAPLEN)? as usize,
                read_u32(block, at + PKT_LEN)? as usize,
                usize::from(read_u16(block, at + PKT_MAC)?),
                *block.get(at + TPACKET3_HDR_ALIGNED + SLL_PKTTYPE)?,
            ))
        })
        .flatten();
    let Some((next, snaplen, wire_len, mac_off, pkttype)) = fields else {
        let lost = cursor.left;
        cursor.left = 0;
        return Step::Corrupt { lost };
    };
    cursor.left -= 1;
    // A next offset shorter than a header would walk backwards or in place: end the walk there
    // (the next call reports the rest as lost).
    cursor.offset = if next >= TPACKET3_HDRLEN { at + next } else { 0 };
    let start = at + mac_off;
    match start.checked_add(snaplen) {
        Some(end) if mac_off >= TPACKET3_HDRLEN && end <= block.len() => Step::Packet {
            frame: start..end,
            wire_len,
            outgoing: pkttype == libc::PACKET_OUTGOING,
            stamp_ns: stamp_at(block, at + PKT_SEC, at + PKT_NSEC),
            partial_csum: read_u32(block, at + PKT_STATUS)
                .is_some_and(|s| s & libc::TP_STATUS_CSUMNOTREADY != 0),
            vlan: vlan_tag(
                read_u32(block, at + PKT_STATUS),
                read_u32(block, at + PKT_VLAN_TCI).map(|t| t as u16),
                read_u16(block, at + PKT_VLAN_TPID),
            ),
        },
        _ => Step::Bad,
    }
}

/// Reads the one packet of a TPACKET_V2 receive slot, checking its offsets against the slot.
fn v2_packet(slot: &[u8]) -> Step {
    let fields = (|| {
        Some((
            read_u32(slot, V2_LEN)? as usize,
            read_u32(slot, V2_SNAPLEN)? as usize,
            usize::from(read_u16(slot, V2_MAC)?),
            *slot.get(TPACKET2_HDR_ALIGNED + SLL_PKTTYPE)?,
        ))
    })();
    let Some((wire_len, snaplen, mac_off, pkttype)) = fields else {
        return Step::Bad;
    };
    match mac_off.checked_add(snaplen) {
        Some(end) if mac_off >= TPACKET2_HDRLEN && end <= slot.len() => Step::Packet {
            frame: mac_off..end,
            wire_len,
            outgoing: pkttype == libc::PACKET_OUTGOING,
            stamp_ns: stamp_at(slot, V2_SEC, V2_NSEC),
            partial_csum: read_u32(slot, V2_STATUS).is_some_and(|s| s & libc::TP_STATUS_CSUMNOTREADY != 0),
            vlan: vlan_tag(
                read_u32(slot, V2_STATUS),
                read_u16(slot, V2_VLAN_TCI),
                read_u16(slot, V2_VLAN_TPID),
            ),
        },
        _ => Step::Bad,
    }
}

/// The fuzz target's body: walks arbitrary bytes as a TPACKET_V3 receive block and reads them as a
/// TPACKET_V2 slot, as the port does with the kernel's rings, and admission-checks every frame
/// found. Panics only if the walk indexes out of bounds or fails to end.
#[cfg(any(test, fuzzing))]
pub fn fuzz_rx_block(data: &[u8]) {
    if let Step::Packet { frame, .. } = v2_packet(data) {
        let _ = check_frame(&data[frame], 1500);
    }
    let mut cursor = RxCursor::start(data);
    let mut steps = 0usize;
    loop {
        match next_packet(data, &mut cursor) {
            Step::Done | Step::Corrupt { .. } => break,
            Step::Bad => {}
            Step::Packet { frame, .. } => {
                let _ = check_frame(&data[frame], 1500);
            }
        }
        steps += 1;
        assert!(steps <= data.len() / TPACKET3_HDRLEN + 1, "the walk does not move forward");
    }
}

/// Where the fields of a transmit slot are, by TPACKET version.
#[derive(Debug, Clone, Copy)]
struct TxOffsets {
    status: usize,
    len: usize,
    snaplen: usize,
    data: usize,
    /// `tp_next_offset` (V3 only; must be 0).
    next: Option<usize>,
}

/// The AF_PACKET port; see the module docs.
pub struct AfPacketPort {
    fd: OwnedFd,
    ifname: String,
    mac: MacAddr,
    mtu: usize,
    /// Frames of every EtherType are delivered (no BPF filter, bound to ETH_P_ALL).
    all_ethertypes: bool,
    /// Where a frame whose checksum the port completes is copied.
    scratch: Vec<u8>,
    map: *mut u8,
    map_len: usize,
    rx_version: RxVersion,
    /// Bytes per receive unit: a block (V3) or a frame slot (V2).
    rx_unit_bytes: usize,
    rx_units: usize,
    rx_unit: usize,
    /// `Some` while the port owns `rx_unit` and is part-way through it.
    rx_cursor: Option<RxCursor>,
    tx_base: usize,
    tx_frame_bytes: usize,
    /// Transmit slots in the ring (kept: a division on every poll was a noticeable part of an
    /// empty one).
    tx_slots: usize,
    tx_head: usize,
    /// Frames marked for sending that the kernel has not been told about.
    tx_unkicked: bool,
    /// System calls that told the kernel to send the transmit ring's slots.
    kicks: u64,
    ignore_outgoing: bool,
    qdisc_bypass: bool,
    counters: PortCounters,
    /// Ring-full drops the kernel reported; `PACKET_STATISTICS` resets on read, so they add up here.
    kernel_drops: Cell<u64>,
    /// The ring-less socket for the first frame of a burst, and the buffer it is written in.
    single: Option<(OwnedFd, Vec<u8>)>,
    /// A socket with PACKET_VNET_HDR for segments larger than the MTU (made on first use; `Err`
    /// once making it failed).
    gso: Option<core::result::Result<OwnedFd, ()>>,
    ifindex: libc::c_int,
}

// SAFETY: the mapping is owned by this value alone (no other handle to it exists in the process)
// and is only touched through `&mut self` or, for counters, not at all; the kernel side of the
// rings synchronises through the status words. Moving the port to another thread is therefore
// sound. (It is not Sync: `kernel_drops` is a Cell.)
unsafe impl Send for AfPacketPort {}

impl core::fmt::Debug for AfPacketPort {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("AfPacketPort")
            .field("ifname", &self.ifname)
            .field("mac", &self.mac)
            .field("mtu", &self.mtu)
            .field("ignore_outgoing", &self.ignore_outgoing)
            .field("qdisc_bypass", &self.qdisc_bypass)
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl AfPacketPort {
    /// Opens the port on `config.ifname`. Unavailable (with what to do) when there is no such
    /// interface, it is down or not Ethernet, or the process lacks CAP_NET_RAW.
    pub fn open(config: &AfPacketConfig) -> Result<AfPacketPort> {
        let spec = format!("afpacket:{}", config.ifname);
        check_ifname(&config.ifname).map_err(|why| PortError::BadSpec { spec: spec.clone(), why })?;
        let info = iface_info(&spec, &config.ifname)?;

        // Protocol 0: the socket receives nothing until it is bound, after the filter and rings.
        // SAFETY: socket() has no memory preconditions; the result is checked.
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EPERM) | Some(libc::EACCES) => PortError::Unavailable {
                    spec,
                    why: "AF_PACKET sockets need CAP_NET_RAW: run as root, or grant it once with \
                          `sudo setcap cap_net_raw+ep $(command -v lanbus)` (or use the udp port, which \
                          needs no privileges)"
                        .into(),
                },
                Some(libc::EAFNOSUPPORT) => PortError::Unavailable {
                    spec,
                    why: "this kernel has no AF_PACKET support (CONFIG_PACKET); use the udp port".into(),
                },
                _ => PortError::io("socket(AF_PACKET)", e),
            });
        }
        // SAFETY: raw is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let version = match config.rx {
            RxVersion::V3 => libc::tpacket_versions::TPACKET_V3,
            RxVersion::V2 => libc::tpacket_versions::TPACKET_V2,
        } as libc::c_int;
        set_option(&fd, libc::SOL_PACKET, libc::PACKET_VERSION, &version)
            .map_err(|e| PortError::io("PACKET_VERSION (TPACKET_V3 needs Linux 3.2+)", e))?;
        let one: libc::c_int = 1;
        set_option(&fd, libc::SOL_PACKET, libc::PACKET_LOSS, &one)
            .map_err(|e| PortError::io("PACKET_LOSS", e))?;
        // Optional speed-ups: the port works without them (older kernels).
        let qdisc_bypass = set_option(&fd, libc::SOL_PACKET, libc::PACKET_QDISC_BYPASS, &one).is_ok();
        let ignore_outgoing = set_option(&fd, libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, &one).is_ok();
        if !config.all_ethertypes {
            let mut filter = lanbus_filter();
            let program = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_mut_ptr() };
            set_option(&fd, libc::SOL_SOCKET, libc::SO_ATTACH_FILTER, &program)
                .map_err(|e| PortError::io("SO_ATTACH_FILTER (EtherType 0x88B5 filter)", e))?;
        }

        let frame_max = HEADER_LEN + info.mtu;
        // With every EtherType the port also receives what the kernel coalesced (GRO) or what a
        // local sender handed over unsegmented (TSO across a veth): IP packets of up to 64 KiB.
        let rx_frame_max = if config.all_ethertypes { frame_max.max(HEADER_LEN + 65535) } else { frame_max };
        // Receive units hold at least one whole maximal frame with its headers: a V3 block its
        // descriptor too, a V2 slot the aligned header plus the kernel's 16 bytes of headroom.
        let (rx_unit_bytes, rx_units, rx_req) = match config.rx {
            RxVersion::V3 => {
                let block = (BLOCK_DESC_LEN + TPACKET3_HDRLEN + 2 * 16 + rx_frame_max)
                    .next_power_of_two()
                    .max(RX_BLOCK_MIN_BYTES);
                let nominal_frame = 2048usize.min(block);
                let req = libc::tpacket_req3 {
                    tp_block_size: block as u32,
                    tp_block_nr: RX_BLOCKS as u32,
                    tp_frame_size: nominal_frame as u32,
                    tp_frame_nr: (RX_BLOCKS * (block / nominal_frame)) as u32,
                    tp_retire_blk_tov: config.tov_ms,
                    tp_sizeof_priv: 0,
                    tp_feature_req_word: 0,
                };
                (block, RX_BLOCKS, req)
            }
            RxVersion::V2 => {
                let frame =
                    (TPACKET2_HDRLEN.next_multiple_of(16) + 16 + rx_frame_max).next_power_of_two().max(2048);
                let block = frame.max(1 << 16);
                // A TCP/IP stack's slots hold coalesced 64 KiB segments but mostly carry single
                // segments: enough of them that a window of those does not overflow the ring.
                let budget = if config.all_ethertypes { 16 * RX_V2_BYTES } else { RX_V2_BYTES };
                let frames = ((budget / frame).clamp(RX_V2_MIN_SLOTS, 1024) / (block / frame)).max(1)
                    * (block / frame);
                // The kernel reads only the first four fields for TPACKET_V2.
                let req = libc::tpacket_req3 {
                    tp_block_size: block as u32,
                    tp_block_nr: (frames / (block / frame)) as u32,
                    tp_frame_size: frame as u32,
                    tp_frame_nr: frames as u32,
                    tp_retire_blk_tov: 0,
                    tp_sizeof_priv: 0,
                    tp_feature_req_word: 0,
                };
                (frame, frames, req)
            }
        };
        set_option(&fd, libc::SOL_PACKET, libc::PACKET_RX_RING, &rx_req)
            .map_err(|e| PortError::io("PACKET_RX_RING (receive ring)", e))?;
        let tx_data = match config.rx {
            RxVersion::V3 => TPACKET3_HDR_ALIGNED,
            RxVersion::V2 => TPACKET2_HDR_ALIGNED,
        };
        let tx_frame_bytes = (tx_data + frame_max).next_power_of_two().max(2048);
        let tx_block_bytes = tx_frame_bytes.max(1 << 16);
        let tx_blocks = (TX_FRAMES * tx_frame_bytes).div_ceil(tx_block_bytes);
        let tx_frames = tx_blocks * (tx_block_bytes / tx_frame_bytes);
        let tx_req = libc::tpacket_req3 {
            tp_block_size: tx_block_bytes as u32,
            tp_block_nr: tx_blocks as u32,
            tp_frame_size: tx_frame_bytes as u32,
            tp_frame_nr: tx_frames as u32,
            tp_retire_blk_tov: 0,
            tp_sizeof_priv: 0,
            tp_feature_req_word: 0,
        };
        set_option(&fd, libc::SOL_PACKET, libc::PACKET_TX_RING, &tx_req)
            .map_err(|e| PortError::io("PACKET_TX_RING (mapped transmit ring)", e))?;

        // Units are laid out back to back: V2 slots divide their blocks exactly.
        let rx_len = rx_unit_bytes * rx_units;
        let map_len = rx_len + tx_block_bytes * tx_blocks;
        // SAFETY: mapping the socket's rings (receive first, then transmit, as the kernel lays
        // them out) at a kernel-chosen address; the result is checked.
        let map = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(PortError::io("mmap of the AF_PACKET rings", std::io::Error::last_os_error()));
        }
        let mut port = AfPacketPort {
            fd,
            ifname: config.ifname.clone(),
            mac: info.mac,
            mtu: info.mtu,
            map: map as *mut u8,
            map_len,
            rx_version: config.rx,
            rx_unit_bytes,
            rx_units,
            rx_unit: 0,
            rx_cursor: None,
            tx_base: rx_len,
            tx_frame_bytes,
            tx_slots: (map_len - rx_len) / tx_frame_bytes,
            tx_head: 0,
            tx_unkicked: false,
            kicks: 0,
            ignore_outgoing,
            qdisc_bypass,
            all_ethertypes: config.all_ethertypes,
            scratch: Vec::new(),
            gso: None,
            ifindex: info.index,
            counters: PortCounters::default(),
            kernel_drops: Cell::new(0),
            single: None,
        };
        // SAFETY: sockaddr_ll is plain old data; all-zero is valid.
        let mut sll: libc::sockaddr_ll = unsafe { core::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = if config.all_ethertypes || config.keep_tags {
            (libc::ETH_P_ALL as u16).to_be()
        } else {
            EtherType::LANBUS_RAW.to_be()
        };
        sll.sll_ifindex = info.index;
        // SAFETY: sll is a valid sockaddr_ll for the call.
        let rc = unsafe {
            libc::bind(
                port.fd.as_raw_fd(),
                &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                core::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ENETDOWN) => PortError::Unavailable {
                    spec,
                    why: format!("interface {} went down: `ip link set {} up`", config.ifname, config.ifname),
                },
                Some(libc::ENODEV) => PortError::Unavailable {
                    spec,
                    why: format!("interface {} disappeared while opening", config.ifname),
                },
                _ => PortError::io("bind of the AF_PACKET socket", e),
            });
        }
        port.single = single_frame_socket(info.index, qdisc_bypass).map(|fd| (fd, vec![0u8; frame_max]));
        Ok(port)
    }

    /// The interface the port is bound to.
    pub fn ifname(&self) -> &str {
        &self.ifname
    }

    /// Whether the kernel took PACKET_IGNORE_OUTGOING (else outgoing frames are skipped in code).
    pub fn ignores_outgoing_in_kernel(&self) -> bool {
        self.ignore_outgoing
    }

    /// Whether transmitted frames bypass the qdisc layer.
    pub fn qdisc_bypass(&self) -> bool {
        self.qdisc_bypass
    }

    /// Whether the first frame of a burst goes out through the ring-less socket (see the module
    /// documentation); without it every frame goes through the transmit ring.
    pub fn sends_single_frames_directly(&self) -> bool {
        self.single.is_some()
    }

    /// System calls made to send the transmit ring's slots (a burst's first frame through the
    /// ring-less socket needs none).
    pub fn kicks(&self) -> u64 {
        self.kicks
    }

    /// Frames the kernel dropped because the receive ring was full (included in `rx_dropped`).
    pub fn kernel_drops(&self) -> u64 {
        self.refresh_kernel_drops();
        self.kernel_drops.get()
    }

    fn refresh_kernel_drops(&self) {
        // SAFETY: tpacket_stats_v3 is plain old data; all-zero is valid.
        let mut stats: libc::tpacket_stats_v3 = unsafe { core::mem::zeroed() };
        let mut len = core::mem::size_of::<libc::tpacket_stats_v3>() as libc::socklen_t;
        // SAFETY: stats and len are live and describe a buffer of the size given.
        let rc = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_STATISTICS,
                &mut stats as *mut _ as *mut libc::c_void,
                &mut len,
            )
        };
        if rc == 0 {
            self.kernel_drops.set(self.kernel_drops.get() + u64::from(stats.tp_drops));
        }
    }

    /// The status word of receive unit `unit` (a V3 block's `block_status`, a V2 slot's
    /// `tp_status`).
    fn unit_status(&self, unit: usize) -> &AtomicU32 {
        debug_assert!(unit < self.rx_units);
        let at = match self.rx_version {
            RxVersion::V3 => BLOCK_STATUS,
            RxVersion::V2 => V2_STATUS,
        };
        // SAFETY: the status word lies at the start of the unit, inside the mapping, and is
        // 4-aligned (units are 16-aligned). The kernel writes it concurrently, hence an atomic view.
        unsafe { &*(self.map.add(unit * self.rx_unit_bytes + at) as *const AtomicU32) }
    }

    /// The status word of transmit slot `slot`.
    fn tx_status(&self, slot: usize) -> &AtomicU32 {
        // SAFETY: the slot lies inside the transmit part of the mapping (slot < TX frames) and
        // tp_status is 4-aligned in a 16-aligned slot; the kernel writes it concurrently.
        unsafe {
            &*(self.map.add(self.tx_base + slot * self.tx_frame_bytes + self.tx_offsets().status)
                as *const AtomicU32)
        }
    }

    fn tx_offsets(&self) -> TxOffsets {
        match self.rx_version {
            RxVersion::V3 => TxOffsets {
                status: PKT_STATUS,
                len: PKT_LEN,
                snaplen: PKT_SNAPLEN,
                data: TPACKET3_HDR_ALIGNED,
                next: Some(PKT_NEXT_OFFSET),
            },
            RxVersion::V2 => TxOffsets {
                status: V2_STATUS,
                len: V2_LEN,
                snaplen: V2_SNAPLEN,
                data: TPACKET2_HDR_ALIGNED,
                next: None,
            },
        }
    }

    /// The current receive unit as bytes. Only call while the port owns it (its status was seen
    /// with TP_STATUS_USER under Acquire and it has not been released).
    ///
    /// The lifetime is not tied to `self` so that counters can be updated while a frame is lent;
    /// callers drop the slice before `release_unit`.
    fn owned_unit<'a>(&self) -> &'a [u8] {
        // SAFETY: the unit lies inside the mapping, which lives as long as the port; while the
        // port owns the unit the kernel does not write to it (it waits for TP_STATUS_KERNEL), and
        // rx_burst drops every slice of it before handing it back.
        unsafe {
            core::slice::from_raw_parts(self.map.add(self.rx_unit * self.rx_unit_bytes), self.rx_unit_bytes)
        }
    }

    fn release_unit(&mut self) {
        // Release: our reads of the unit happen before the kernel may refill it; pairs with the
        // kernel's status read (smp_rmb) before it writes a slot or opens a block.
        self.unit_status(self.rx_unit).store(libc::TP_STATUS_KERNEL, Ordering::Release);
        self.rx_cursor = None;
        self.rx_unit = self.next_unit();
    }

    /// The receive unit after the current one (wrapping by comparison, not `%`: this runs for
    /// every frame).
    fn next_unit(&self) -> usize {
        if self.rx_unit + 1 == self.rx_units {
            0
        } else {
            self.rx_unit + 1
        }
    }

    /// The PACKET_VNET_HDR socket, made on first use. It never bypasses the qdisc layer: the
    /// direct path drops a frame the device cannot take whole (a device with segmentation
    /// offload off: every such send failed with ENOBUFS), while the queued path cuts it in
    /// software first, as Linux does for its own TCP.
    fn gso_socket(&mut self) -> Option<&OwnedFd> {
        if self.gso.is_none() {
            let made = single_frame_socket(self.ifindex, false).filter(|fd| {
                let one: libc::c_int = 1;
                set_option(fd, libc::SOL_PACKET, libc::PACKET_VNET_HDR, &one).is_ok()
            });
            self.gso = Some(made.ok_or(()));
        }
        self.gso.as_ref().and_then(|r| r.as_ref().ok())
    }

    /// Sends one frame through the ring-less socket `fd` from the caller's memory; a frame the
    /// port cannot carry, or the kernel refuses, is dropped and counted.
    fn send_lone(&mut self, fd: libc::c_int, frame: &[u8], capacity: usize) -> Result<()> {
        if !(HEADER_LEN..=capacity).contains(&frame.len()) {
            self.counters.tx_dropped += 1;
            return Ok(());
        }
        loop {
            // SAFETY: reads frame.len() bytes from a live slice.
            let rc = unsafe { libc::send(fd, frame.as_ptr().cast(), frame.len(), libc::MSG_DONTWAIT) };
            if rc >= 0 {
                self.counters.tx_frames += 1;
                self.counters.tx_bytes += frame.len() as u64;
                return Ok(());
            }
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::ENETDOWN | libc::ENXIO) => return Err(self.went_down()),
                _ => {
                    // Device queue full (or gone): lost, as on a wire; the transport resends it.
                    self.counters.tx_dropped += 1;
                    return Ok(());
                }
            }
        }
    }

    /// The ring-less socket, if frames may go through it now: frames waiting in the ring must
    /// leave first, or the other socket would overtake them.
    fn borrowing_socket(&self) -> Option<libc::c_int> {
        match &self.single {
            Some((fd, _)) if !self.ring_waits() => Some(fd.as_raw_fd()),
            _ => None,
        }
    }

    /// Sends `count` frames through `fd`, up to 32 a `sendmmsg`; frame `i` is `piece(i)`'s two
    /// pieces one after the other. A frame of a wrong length, or one the device's full queue
    /// refuses, is counted as dropped, as a wire would lose it. Returns `count`.
    fn send_gathered<'a>(
        &mut self,
        fd: libc::c_int,
        count: usize,
        piece: impl Fn(usize) -> [&'a [u8]; 2],
    ) -> Result<usize> {
        const CHUNK: usize = 32;
        let capacity = self.frame_capacity();
        let mut next = 0;
        while next < count {
            // SAFETY: iovec and mmsghdr are plain old data; all-zero is valid (null pointers,
            // zero lengths).
            let mut iov: [[libc::iovec; 2]; CHUNK] = unsafe { core::mem::zeroed() };
            let mut lens = [0usize; CHUNK];
            let mut pieces = [0usize; CHUNK];
            let mut n = 0;
            while next < count && n < CHUNK {
                let frame = piece(next);
                next += 1;
                let len = frame[0].len() + frame[1].len();
                if !(HEADER_LEN..=capacity).contains(&len) {
                    self.counters.tx_dropped += 1;
                    continue;
                }
                for (v, p) in iov[n].iter_mut().zip(frame.iter().filter(|p| !p.is_empty())) {
                    // The kernel only reads through iov_base (sendmmsg's data is const in effect).
                    *v = libc::iovec { iov_base: p.as_ptr() as *mut libc::c_void, iov_len: p.len() };
                    pieces[n] += 1;
                }
                lens[n] = len;
                n += 1;
            }
            // SAFETY: as above.
            let mut msgs: [libc::mmsghdr; CHUNK] = unsafe { core::mem::zeroed() };
            for ((m, v), &k) in msgs.iter_mut().zip(iov.iter_mut()).zip(&pieces).take(n) {
                m.msg_hdr.msg_iov = v.as_mut_ptr();
                m.msg_hdr.msg_iovlen = k;
            }
            let mut done = 0;
            while done < n {
                // SAFETY: msgs[done..n] are initialised headers whose iovecs point into frames
                // the caller lends for the call; the socket is bound, so no address.
                let rc = unsafe {
                    libc::sendmmsg(
                        fd,
                        msgs.as_mut_ptr().add(done),
                        (n - done) as libc::c_uint,
                        libc::MSG_DONTWAIT,
                    )
                };
                if rc > 0 {
                    let sent = rc as usize;
                    self.counters.tx_frames += sent as u64;
                    self.counters.tx_bytes += lens[done..done + sent].iter().sum::<usize>() as u64;
                    done += sent;
                    continue;
                }
                match std::io::Error::last_os_error().raw_os_error() {
                    Some(libc::EINTR) => {}
                    Some(libc::ENETDOWN | libc::ENXIO) => return Err(self.went_down()),
                    _ => {
                        // Device queue full (or gone): the frame is lost, as on a wire; the
                        // transport resends it.
                        self.counters.tx_dropped += 1;
                        done += 1;
                    }
                }
            }
        }
        Ok(count)
    }

    fn went_down(&self) -> PortError {
        PortError::Unavailable {
            spec: format!("afpacket:{}", self.ifname),
            why: format!("interface {} went down: `ip link set {} up`", self.ifname, self.ifname),
        }
    }

    /// Whether frames wait in the transmit ring: not kicked yet, or left by a kick the kernel cut
    /// short (its send buffer full), which leaves the newest slot still marked SEND_REQUEST.
    fn ring_waits(&self) -> bool {
        let prev = if self.tx_head == 0 { self.tx_slots - 1 } else { self.tx_head - 1 };
        // Acquire: the status the kernel last wrote.
        self.tx_unkicked || self.tx_status(prev).load(Ordering::Acquire) == libc::TP_STATUS_SEND_REQUEST
    }

    fn kick(&mut self) -> Result<()> {
        // SAFETY: a zero-length send with no address tells the kernel to transmit the slots
        // marked SEND_REQUEST; no user memory is passed.
        let rc = unsafe { libc::send(self.fd.as_raw_fd(), core::ptr::null(), 0, libc::MSG_DONTWAIT) };
        self.kicks += 1;
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) | Some(libc::EINTR) => {
                    self.tx_unkicked = true;
                    return Ok(());
                }
                Some(libc::ENETDOWN) | Some(libc::ENXIO) => {
                    return Err(PortError::Unavailable {
                        spec: format!("afpacket:{}", self.ifname),
                        why: format!("interface {} went down: `ip link set {} up`", self.ifname, self.ifname),
                    })
                }
                _ => return Err(PortError::io("send on the AF_PACKET transmit ring", e)),
            }
        }
        self.tx_unkicked = false;
        Ok(())
    }
}

impl AsRawFd for AfPacketPort {
    /// The packet socket, for callers that multiplex ports in their own epoll set.
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

impl Drop for AfPacketPort {
    fn drop(&mut self) {
        // SAFETY: map/map_len are the mapping made in `open`; no borrow of it outlives `self`.
        unsafe { libc::munmap(self.map as *mut libc::c_void, self.map_len) };
    }
}

impl Port for AfPacketPort {
    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> Result<usize> {
        self.rx_burst_stamped(max, &mut |frame, _| on_frame(frame))
    }

    fn rx_burst_stamped(
        &mut self,
        max: usize,
        on_frame: &mut dyn FnMut(&[u8], Option<u64>),
    ) -> Result<usize> {
        // Slots marked for sending while the kernel had no room go out without new frames.
        if self.tx_unkicked {
            self.kick()?;
        }
        let mut delivered = 0;
        while delivered < max {
            if self.rx_cursor.is_none() {
                // Acquire: the kernel's writes of the packets and the descriptor happen before it
                // sets TP_STATUS_USER (smp_wmb in prb_close_block); pairs with that store.
                // (For V2: the slot's data and header before tp_status; tpacket_rcv's smp_wmb.)
                let status = self.unit_status(self.rx_unit).load(Ordering::Acquire);
                if status & libc::TP_STATUS_USER == 0 {
                    break;
                }
                // The next unit's status is what this loop (or the next poll) reads after this
                // one: ask for it now, while the frames here are handled.
                prefetch(self.unit_status(self.next_unit()));
                self.rx_cursor = Some(match self.rx_version {
                    RxVersion::V3 => RxCursor::start(self.owned_unit()),
                    RxVersion::V2 => RxCursor { left: 1, offset: 0 },
                });
            }
            let mut cursor = self.rx_cursor.expect("set above");
            let block = self.owned_unit();
            let step = match self.rx_version {
                RxVersion::V3 => next_packet(block, &mut cursor),
                RxVersion::V2 if cursor.left == 0 => Step::Done,
                RxVersion::V2 => {
                    cursor.left = 0;
                    v2_packet(block)
                }
            };
            self.rx_cursor = Some(cursor);
            match step {
                Step::Done => self.release_unit(),
                Step::Corrupt { lost } => {
                    self.counters.rx_dropped += u64::from(lost);
                    self.release_unit();
                }
                Step::Bad => self.counters.rx_dropped += 1,
                // Our own (or this host's) transmission looped back to packet taps: not for us.
                Step::Packet { outgoing: true, .. } => {}
                Step::Packet { frame, wire_len, outgoing: false, stamp_ns, partial_csum, vlan } => {
                    let frame = &block[frame];
                    prefetch_lines(frame);
                    let admitted = if self.all_ethertypes {
                        (HEADER_LEN..=HEADER_LEN + 65535.max(self.mtu)).contains(&frame.len())
                    } else {
                        check_frame(frame, self.mtu).is_ok()
                    };
                    if frame.len() < wire_len || !admitted {
                        self.counters.rx_dropped += 1;
                        continue;
                    }
                    self.counters.rx_frames += 1;
                    self.counters.rx_bytes += frame.len() as u64;
                    delivered += 1;
                    let complete_csum = partial_csum && self.all_ethertypes;
                    if complete_csum || vlan.is_some() {
                        self.scratch.clear();
                        self.scratch.extend_from_slice(frame);
                        if complete_csum {
                            // A host's own stack would trust the kernel's word; a stack above this
                            // port checks every checksum, so finish it as the NIC would have.
                            crate::csum::complete_partial_checksum(&mut self.scratch);
                        }
                        if let Some((tpid, tci)) = vlan {
                            // The tag back where it was on the wire, for the VLAN port above.
                            let tag = [tpid.to_be_bytes(), tci.to_be_bytes()].concat();
                            self.scratch.splice(12..12, tag);
                        }
                        on_frame(&self.scratch, (stamp_ns != 0).then_some(stamp_ns));
                        continue;
                    }
                    on_frame(frame, (stamp_ns != 0).then_some(stamp_ns));
                }
            }
        }
        // Give a finished block back now rather than on the next call, so the kernel can reuse it.
        if let Some(RxCursor { left: 0, .. }) = self.rx_cursor {
            self.release_unit();
        }
        Ok(delivered)
    }

    fn tx_burst(&mut self, max: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> Result<usize> {
        let capacity = self.frame_capacity();
        let slots = self.tx_slots;
        let mut sent = 0;
        let mut offered = 0;
        // Frames this burst put in the ring: only those need a kick (a system call).
        let mut in_ring = 0;
        // The burst's first frame through the ring-less socket, unless frames wait in the ring
        // (they must leave first).
        let ring_waits = self.ring_waits();
        if let Some((fd, buf)) = self.single.as_mut().filter(|_| !ring_waits && max > 0) {
            let Some(len) = fill(&mut buf[..capacity]) else { return Ok(0) };
            offered += 1;
            if !(HEADER_LEN..=capacity).contains(&len) {
                self.counters.tx_dropped += 1;
            } else {
                // SAFETY: buf[..len] is initialised memory the kernel only reads.
                let rc = unsafe { libc::send(fd.as_raw_fd(), buf.as_ptr().cast(), len, libc::MSG_DONTWAIT) };
                let error = (rc < 0).then(std::io::Error::last_os_error);
                if rc == len as isize {
                    self.counters.tx_frames += 1;
                    self.counters.tx_bytes += len as u64;
                    sent += 1;
                } else if let Some(libc::ENETDOWN | libc::ENXIO) =
                    error.as_ref().and_then(|e| e.raw_os_error())
                {
                    return Err(self.went_down());
                } else {
                    // Device queue full or gone: the frame is lost, as on a wire; the transport
                    // resends it.
                    self.counters.tx_dropped += 1;
                }
            }
        }
        while offered < max {
            let slot = self.tx_head;
            // Acquire: the kernel finished reading the slot before it set it AVAILABLE (or
            // WRONG_FORMAT); pairs with its smp_wmb + status store in tpacket_destruct_skb.
            let status = self.tx_status(slot).load(Ordering::Acquire);
            if status == libc::TP_STATUS_WRONG_FORMAT {
                self.counters.tx_dropped += 1;
            } else if status != libc::TP_STATUS_AVAILABLE {
                // The ring is full: the caller keeps its frames.
                self.tx_unkicked = true;
                break;
            }
            let base = self.tx_base + slot * self.tx_frame_bytes;
            let off = self.tx_offsets();
            // SAFETY: the slot's data area [base + 48, base + 48 + capacity) lies inside the slot
            // (tx_frame_bytes >= 48 + mtu + 14) and the port owns the slot (status AVAILABLE).
            let buf = unsafe { core::slice::from_raw_parts_mut(self.map.add(base + off.data), capacity) };
            let Some(len) = fill(buf) else { break };
            offered += 1;
            if !(HEADER_LEN..=capacity).contains(&len) {
                self.counters.tx_dropped += 1;
                continue;
            }
            // SAFETY: the header fields lie at the start of the owned slot.
            unsafe {
                let hdr = self.map.add(base);
                if let Some(next) = off.next {
                    core::ptr::write_unaligned(hdr.add(next) as *mut u32, 0);
                }
                core::ptr::write_unaligned(hdr.add(off.len) as *mut u32, len as u32);
                core::ptr::write_unaligned(hdr.add(off.snaplen) as *mut u32, len as u32);
            }
            // Release: the frame and tp_len are written before the kernel sees SEND_REQUEST;
            // pairs with the kernel's status read (smp_rmb) in tpacket_snd.
            self.tx_status(slot).store(libc::TP_STATUS_SEND_REQUEST, Ordering::Release);
            self.tx_head = if slot + 1 == slots { 0 } else { slot + 1 };
            self.counters.tx_frames += 1;
            self.counters.tx_bytes += len as u64;
            sent += 1;
            in_ring += 1;
        }
        if in_ring > 0 || self.tx_unkicked {
            self.kick()?;
        }
        Ok(sent)
    }

    fn borrows_frames(&self) -> bool {
        self.single.is_some()
    }

    /// Up to 32 frames a system call (`sendmmsg`) through the ring-less socket, which copies
    /// each from the caller's memory into the kernel's buffer. Through the transmit ring a frame
    /// is copied into the ring and then, on a veth, once more by the kernel (the ring's pages
    /// cannot be handed to a local receiver); this way it is copied once.
    fn tx_borrowed(&mut self, frames: &[&[u8]]) -> Result<usize> {
        let Some(fd) = self.borrowing_socket() else { return self.send_frames(frames) };
        if let [frame] = frames {
            // A lone frame (a small message's usual burst): send(2), no message headers.
            self.send_lone(fd, frame, self.frame_capacity())?;
            return Ok(1);
        }
        self.send_gathered(fd, frames.len(), |i| [frames[i], &[]])
    }

    /// As [`Port::tx_borrowed`], each frame gathered from its two pieces by the kernel as it
    /// copies it (two iovecs a message).
    fn tx_borrowed_parts(&mut self, frames: &[[&[u8]; 2]]) -> Result<usize> {
        let Some(fd) = self.borrowing_socket() else { return crate::copy_parts(self, frames) };
        if let [[frame, []]] = frames {
            self.send_lone(fd, frame, self.frame_capacity())?;
            return Ok(1);
        }
        self.send_gathered(fd, frames.len(), |i| frames[i])
    }

    fn readiness_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.as_raw_fd())
    }

    fn tx_gso(&mut self, frame: &[u8], gso: crate::Gso) -> Result<bool> {
        if frame.len() > HEADER_LEN + 65535 || frame.len() <= usize::from(gso.header_bytes) {
            self.counters.tx_dropped += 1;
            return Ok(true);
        }
        // Frames already in the ring leave first.
        if self.tx_unkicked {
            self.kick()?;
        }
        let Some(fd) = self.gso_socket().map(|fd| fd.as_raw_fd()) else { return Ok(false) };
        // struct virtio_net_hdr in the host's byte order: flags, gso_type, hdr_len, gso_size,
        // csum_start, csum_offset.
        const NEEDS_CSUM: u8 = 1;
        const GSO_TCPV4: u8 = 1;
        const GSO_TCPV6: u8 = 4;
        let mut hdr = [0u8; 10];
        hdr[0] = NEEDS_CSUM;
        hdr[1] = if gso.ipv6 { GSO_TCPV6 } else { GSO_TCPV4 };
        hdr[2..4].copy_from_slice(&gso.header_bytes.to_ne_bytes());
        hdr[4..6].copy_from_slice(&gso.segment_bytes.to_ne_bytes());
        hdr[6..8].copy_from_slice(&gso.csum_start.to_ne_bytes());
        hdr[8..10].copy_from_slice(&gso.csum_offset.to_ne_bytes());
        let iov = [
            libc::iovec { iov_base: hdr.as_ptr() as *mut libc::c_void, iov_len: hdr.len() },
            libc::iovec { iov_base: frame.as_ptr() as *mut libc::c_void, iov_len: frame.len() },
        ];
        // SAFETY: msghdr is plain data; zero is a valid initial value.
        let mut msg: libc::msghdr = unsafe { core::mem::zeroed() };
        msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = 2;
        // SAFETY: msg points at two live iovecs over buffers the kernel only reads. Never blocks:
        // a full socket buffer is a full queue, which the caller handles.
        let rc = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                // The device's queue is full: the caller keeps the frame and tries again, as
                // with a full ring.
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) | Some(libc::EINTR) => {
                    Err(PortError::io("send of a segmentation-offloaded frame (queue full)", e))
                }
                // The device takes no offloaded segments: segment in user space from now on.
                Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => {
                    self.gso = Some(Err(()));
                    Ok(false)
                }
                _ => {
                    self.counters.tx_dropped += 1;
                    Err(PortError::io("send of a segmentation-offloaded frame", e))
                }
            };
        }
        self.counters.tx_frames += 1;
        self.counters.tx_bytes += frame.len() as u64;
        Ok(true)
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<()> {
        if self.rx_cursor.is_some() {
            return Ok(());
        }
        // Acquire as in rx_burst: a block already handed over needs no sleep.
        if self.unit_status(self.rx_unit).load(Ordering::Acquire) & libc::TP_STATUS_USER != 0 {
            return Ok(());
        }
        poll_ready(self.fd.as_raw_fd(), false, timeout)
    }

    fn mtu(&self) -> usize {
        self.mtu
    }

    fn mac(&self) -> MacAddr {
        self.mac
    }

    fn counters(&self) -> PortCounters {
        self.refresh_kernel_drops();
        let mut c = self.counters;
        c.rx_dropped += self.kernel_drops.get();
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block as the kernel lays it out, holding `packets` (frame bytes, pkttype), each slot
    /// padded to 16 bytes.
    fn block(packets: &[(&[u8], u8)], size: usize) -> Vec<u8> {
        let mut b = vec![0u8; size];
        b[BLOCK_NUM_PKTS..BLOCK_NUM_PKTS + 4].copy_from_slice(&(packets.len() as u32).to_ne_bytes());
        b[BLOCK_FIRST_PKT..BLOCK_FIRST_PKT + 4].copy_from_slice(&(BLOCK_DESC_LEN as u32).to_ne_bytes());
        let mut at = BLOCK_DESC_LEN;
        for (i, (frame, pkttype)) in packets.iter().enumerate() {
            let mac = TPACKET3_HDRLEN.next_multiple_of(16) + 2;
            let slot = (mac + frame.len()).next_multiple_of(16);
            let next = if i + 1 == packets.len() { 0 } else { slot as u32 };
            b[at..at + 4].copy_from_slice(&next.to_ne_bytes());
            b[at + PKT_SNAPLEN..at + PKT_SNAPLEN + 4].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
            b[at + PKT_LEN..at + PKT_LEN + 4].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
            b[at + PKT_MAC..at + PKT_MAC + 2].copy_from_slice(&(mac as u16).to_ne_bytes());
            b[at + TPACKET3_HDR_ALIGNED + SLL_PKTTYPE] = *pkttype;
            // Received at 1700000000.000000123 plus a second per packet.
            b[at + PKT_SEC..at + PKT_SEC + 4].copy_from_slice(&(1_700_000_000 + i as u32).to_ne_bytes());
            b[at + PKT_NSEC..at + PKT_NSEC + 4].copy_from_slice(&123u32.to_ne_bytes());
            b[at + mac..at + mac + frame.len()].copy_from_slice(frame);
            at += slot;
        }
        b
    }

    fn walk(b: &[u8]) -> Vec<Step> {
        let mut c = RxCursor::start(b);
        let mut steps = Vec::new();
        loop {
            let s = next_packet(b, &mut c);
            let end = matches!(s, Step::Done | Step::Corrupt { .. });
            steps.push(s);
            if end {
                return steps;
            }
        }
    }

    #[test]
    fn walks_a_well_formed_block() {
        let (one, two) = ([1u8; 60], [2u8; 100]);
        let b = block(&[(&one, libc::PACKET_HOST), (&two, libc::PACKET_OUTGOING)], 4096);
        let steps = walk(&b);
        assert_eq!(steps.len(), 3);
        let Step::Packet { frame, wire_len: 60, outgoing: false, stamp_ns, .. } = steps[0].clone() else {
            panic!("{steps:?}")
        };
        assert_eq!(&b[frame], &one[..]);
        let first = stamp_ns;
        let Step::Packet { frame, wire_len: 100, outgoing: true, stamp_ns, .. } = steps[1].clone() else {
            panic!("{steps:?}")
        };
        assert_eq!(&b[frame], &two[..]);
        assert_eq!(first % 1_000_000_000, 123, "the kernel's receive time, seconds and nanoseconds");
        assert_eq!(stamp_ns - first, 1_000_000_000);
        assert_eq!(steps[2], Step::Done);
    }

    #[test]
    fn distrusts_offsets_and_lengths() {
        let frame = [3u8; 64];
        let good = block(&[(&frame, 0), (&frame, 0), (&frame, 0)], 4096);
        // A snap length running past the block: that packet is bad, the walk goes on.
        let mut b = good.clone();
        b[BLOCK_DESC_LEN + PKT_SNAPLEN..BLOCK_DESC_LEN + PKT_SNAPLEN + 4]
            .copy_from_slice(&5000u32.to_ne_bytes());
        assert_eq!(walk(&b).iter().filter(|s| matches!(s, Step::Packet { .. })).count(), 2);
        assert_eq!(walk(&b)[0], Step::Bad);
        // A next offset of zero before the last packet: the rest is lost, nothing repeats.
        let mut b = good.clone();
        b[BLOCK_DESC_LEN..BLOCK_DESC_LEN + 4].copy_from_slice(&0u32.to_ne_bytes());
        let steps = walk(&b);
        assert!(matches!(steps[0], Step::Packet { .. }));
        assert_eq!(steps[1], Step::Corrupt { lost: 2 });
        // A packet count far beyond what the block holds.
        let mut b = good.clone();
        b[BLOCK_NUM_PKTS..BLOCK_NUM_PKTS + 4].copy_from_slice(&u32::MAX.to_ne_bytes());
        let steps = walk(&b);
        assert_eq!(steps.len(), 4, "{steps:?}");
        assert!(matches!(steps[3], Step::Corrupt { .. }));
        // A first offset inside the descriptor.
        let mut b = good;
        b[BLOCK_FIRST_PKT..BLOCK_FIRST_PKT + 4].copy_from_slice(&4u32.to_ne_bytes());
        assert_eq!(walk(&b), vec![Step::Corrupt { lost: 3 }]);
    }

    #[test]
    fn reads_a_v2_slot_and_distrusts_it() {
        let mut slot = vec![0u8; 2048];
        let frame = [5u8; 90];
        let mac = 66usize;
        slot[V2_LEN..V2_LEN + 4].copy_from_slice(&90u32.to_ne_bytes());
        slot[V2_SNAPLEN..V2_SNAPLEN + 4].copy_from_slice(&90u32.to_ne_bytes());
        slot[V2_MAC..V2_MAC + 2].copy_from_slice(&(mac as u16).to_ne_bytes());
        slot[mac..mac + 90].copy_from_slice(&frame);
        slot[V2_SEC..V2_SEC + 4].copy_from_slice(&2u32.to_ne_bytes());
        slot[V2_NSEC..V2_NSEC + 4].copy_from_slice(&5u32.to_ne_bytes());
        assert_eq!(
            v2_packet(&slot),
            Step::Packet {
                frame: mac..mac + 90,
                wire_len: 90,
                outgoing: false,
                stamp_ns: 2_000_000_005,
                partial_csum: false,
                vlan: None,
            }
        );
        // A tag the kernel took out of the frame is reported with it (TPID 0x8100 when the
        // kernel does not say).
        let mut tagged = slot.clone();
        tagged[V2_STATUS..V2_STATUS + 4].copy_from_slice(&TP_STATUS_VLAN_VALID.to_ne_bytes());
        tagged[V2_VLAN_TCI..V2_VLAN_TCI + 2].copy_from_slice(&0x2007u16.to_ne_bytes());
        assert!(matches!(v2_packet(&tagged), Step::Packet { vlan: Some((0x8100, 0x2007)), .. }));
        slot[TPACKET2_HDR_ALIGNED + SLL_PKTTYPE] = libc::PACKET_OUTGOING;
        assert!(matches!(v2_packet(&slot), Step::Packet { outgoing: true, .. }));
        let mut bad = slot.clone();
        bad[V2_SNAPLEN..V2_SNAPLEN + 4].copy_from_slice(&4000u32.to_ne_bytes());
        assert_eq!(v2_packet(&bad), Step::Bad);
        let mut bad = slot.clone();
        bad[V2_MAC..V2_MAC + 2].copy_from_slice(&8u16.to_ne_bytes());
        assert_eq!(v2_packet(&bad), Step::Bad, "frame overlapping the header");
        assert_eq!(v2_packet(&slot[..10]), Step::Bad);
    }

    proptest::proptest! {
        #[test]
        fn random_blocks_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..2048)) {
            fuzz_rx_block(&bytes);
        }

        #[test]
        fn mutated_blocks_never_panic(at in 0usize..512, value in proptest::num::u32::ANY) {
            let frame = [9u8; 80];
            let mut b = block(&[(&frame, 0), (&frame, 0), (&frame, 4)], 1024);
            let at = at.min(b.len() - 4);
            b[at..at + 4].copy_from_slice(&value.to_ne_bytes());
            fuzz_rx_block(&b);
        }
    }
}
