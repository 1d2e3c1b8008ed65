//! Port specs: how users name a port (`--port SPEC` on the command line, `port = "SPEC"` in a
//! daemon's TOML file).
//!
//! Layer: ports (the front door). A spec string is `KIND[:ARGS]`; it is parsed once, with
//! [`str::parse`], into a typed [`PortSpec`] (the kind and its options as fields), and
//! [`PortSpec::open`] opens the port it names. [`SPEC_HELP`] documents every spec for
//! `lanbus --help` and the README. Errors are [`PortError::BadSpec`] when the string is malformed
//! (from parsing) and [`PortError::Unavailable`] when the port cannot be opened here (not root, no
//! such interface, not built in), each saying what to do.
//!
//! Invariants: parsing never panics, whatever the text. `Display` writes a spec's canonical string
//! (the kind's main argument first, then its options in a fixed order, defaults left out), and
//! parsing that string gives the same [`PortSpec`] back: for every `s` that parses,
//! `s.parse::<PortSpec>()?.to_string().parse() == s.parse()`. The generic options `loss=`,
//! `loss_seed=` and `vlan=` may stand anywhere among a spec's comma-separated arguments; they are
//! taken out before the kind's own arguments are read, so no kind's arguments ever hold one.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::afpacket::{check_ifname, AfPacketConfig, AfPacketPort, RxVersion};
use crate::afxdp::{TxRequest, XdpModeRequest};
use crate::fault::{FaultConfig, FaultyPort};
use crate::udp::{derived_mac, UdpConfig, UdpPort};
use crate::vlan::VlanPort;
use crate::{Port, PortError, Result};

/// Every port spec, one paragraph each; printed by `lanbus --help` and copied into the README.
pub const SPEC_HELP: &str = "\
PORT SPECS (--port SPEC)
  sim
      The in-process simulated wire of `lanbus demo` and the simulator, which hold both ends;
      a daemon cannot open it (two daemons without root: use udp on loopback).
  udp:BIND_IP:PORT[,peer=[MAC@]IP:PORT]...[,mac=MAC][,bcast=IP:PORT][,learn][,mtu=BYTES]
      lanbus frames inside UDP datagrams (kernel sockets, sendmmsg/recvmmsg). Works without
      root, through loopback and across routed IP networks. Name every peer; a peer given
      without MAC@ has the MAC derived from its address, which is the MAC a port bound to
      that address gives itself when mac= is not set. Broadcast frames go to every peer and
      to bcast= (IPv4 only). Datagrams from unknown senders are counted and dropped unless
      `learn` is set. Default MTU 1472 (IPv4) / 1452 (IPv6). Example, two daemons on a laptop:
        udp:127.0.0.1:7000,peer=127.0.0.1:7001   and   udp:127.0.0.1:7001,peer=127.0.0.1:7000
  afpacket:IFACE[,rx=v2|v3][,tov_ms=MS][,ethertypes=all][,tags=keep]
      Raw Ethernet (EtherType 0x88B5) on interface IFACE through AF_PACKET with PACKET_MMAP
      rings (receive ring, mapped transmit ring, qdisc bypass, BPF filter). Needs root or
      CAP_NET_RAW and an Ethernet interface that is up. rx=v2 (default): TPACKET_V2, every
      frame handed over at once. rx=v3: TPACKET_V3 receive blocks, handed over when full or
      after tov_ms (default 1 ms): batches for streaming, but a lone frame (a request, an ACK)
      waits that long, since the kernel cannot hand over a block early. ethertypes=all: every
      frame, not only lanbus's (what the TCP/IP stack server `lanbus stackd` uses).
      tags=keep: frames keep their 802.1Q tags (what vlan=group, below, uses).
  afxdp:IFACE[:QUEUE][,xdp=auto|native|generic][,tx=auto|ring]
      AF_XDP socket on IFACE's queue QUEUE (default 0) with an XDP program that takes only
      EtherType 0x88B5. Needs root and Linux 5.x+. xdp=auto (default): the program runs in the
      driver (native) where it can, in generic mode otherwise, and in generic mode first on veth,
      where that is faster for frames its peer sends. xdp=native: fail where the driver has no
      XDP. xdp=generic: always generic (SKB) mode. tx=auto (default): where the socket is in
      copy mode (no zero-copy driver; veth), a lone frame goes out through a plain AF_PACKET
      send, cheaper there than AF_XDP's copy-mode transmit; bursts go through the tx ring.
      tx=ring: every frame through the tx ring.
  shm:PATH
      Two processes on one machine through shared-memory rings; PATH is the control socket.
  dpdk:EAL_ARGS
      A DPDK port (space-separated EAL arguments, e.g. dpdk:-l 1 --vdev=net_af_packet0,iface=eth1).
      Needs a build with --features dpdk (Debian package libdpdk-dev) and hugepages or --no-huge.
  Any spec with arguments also takes ,loss=P[,loss_seed=N]
      The port drops each frame it receives and each frame it sends with probability P (0 to 1),
      drawn from a generator seeded with N (default: from the port's MAC address), and counts
      them as dropped. For trying recovery over real links: a frame crossing two such ports is
      lost with probability about 2P.
  afpacket, afxdp and dpdk specs also take ,vlan=group
      Every frame carries the node's group as its 802.1Q VLAN ID (groups 0 to 4094), and only
      frames tagged with it are taken: a switch with VLANs keeps groups apart. The frames are 4
      bytes shorter than the link's MTU. Untagged (the default) is what every node must agree on.
      AF_XDP sees a tag only while it is in the frame's bytes: turn the receiving NIC's VLAN
      offload off (ethtool -K IFACE rxvlan off), and on a Linux bridge turn its ports' tag
      insertion off (ethtool -K PORT txvlan off), or use afpacket, to which the kernel hands
      the tag over.
";

fn bad(spec: &str, why: impl Into<String>) -> PortError {
    PortError::BadSpec { spec: spec.to_string(), why: why.into() }
}

fn unavailable(spec: &str, why: impl Into<String>) -> PortError {
    PortError::Unavailable { spec: spec.to_string(), why: why.into() }
}

/// The kinds a spec may name, for error messages.
const KINDS: &str = "sim, udp, afpacket, afxdp, shm, dpdk";

/// A parsed port spec: which port, with which options; see [`SPEC_HELP`] for the text form.
///
/// Built by parsing, or by hand; `Display` writes the canonical text form. [`PortSpec::open`]
/// opens the port, checking a spec built by hand as the parser would.
///
/// ```
/// use lanbus_port::{PortKind, PortSpec};
///
/// let spec: PortSpec = " udp:127.0.0.1:7000, peer=127.0.0.1:7001, loss=0.01 ".parse()?;
/// let PortKind::Udp(udp) = &spec.kind else { unreachable!() };
/// assert_eq!(udp.peers.len(), 1);
/// assert_eq!(spec.to_string(), "udp:127.0.0.1:7000,peer=127.0.0.1:7001,loss=0.01");
/// assert_eq!(spec.to_string().parse::<PortSpec>()?, spec);
/// let bad = "afxdp:eth0:q".parse::<PortSpec>().unwrap_err().to_string();
/// assert!(bad.contains("queue \"q\" is not a receive queue number"));
/// # Ok::<(), lanbus_port::PortError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct PortSpec {
    /// The port and its own options.
    pub kind: PortKind,
    /// Injected loss (`,loss=P[,loss_seed=N]`): the port is wrapped in a [`FaultyPort`].
    pub loss: Option<LossSpec>,
    /// Groups as 802.1Q VLANs (`,vlan=group`): the port is wrapped in a [`VlanPort`]. Only for
    /// kinds that send raw Ethernet frames (afpacket, afxdp, dpdk).
    pub vlan: bool,
}

/// Which port a spec names, with the options of that kind.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PortKind {
    /// `sim`: the in-process simulated wire, which a spec cannot open (both ends are created
    /// together); named so that the error can say what to use instead.
    Sim,
    /// `udp:BIND_IP:PORT[,peer=[MAC@]IP:PORT]...[,mac=MAC][,bcast=IP:PORT][,learn][,mtu=BYTES]`.
    Udp(UdpConfig),
    /// `afpacket:IFACE[,rx=v2|v3][,tov_ms=MS][,ethertypes=all][,tags=keep]`.
    AfPacket(AfPacketConfig),
    /// `afxdp:IFACE[:QUEUE][,xdp=auto|native|generic][,tx=auto|ring]`.
    AfXdp {
        /// The interface name.
        ifname: String,
        /// The receive queue (default 0).
        queue: u32,
        /// How the XDP program is attached.
        xdp: XdpModeRequest,
        /// How frames are sent.
        tx: TxRequest,
    },
    /// `shm:PATH`: shared-memory rings between two processes; `PATH` is the control socket. The
    /// text form holds the path as UTF-8 (a parsed path always is).
    Shm {
        /// The control socket's path.
        path: PathBuf,
    },
    /// `dpdk:EAL_ARGS`: a DPDK port (needs the `dpdk` cargo feature to open).
    Dpdk {
        /// The EAL arguments, one word each (the text form separates them with spaces).
        eal_args: Vec<String>,
    },
}

/// Injected loss: each frame received and each frame sent is dropped with probability `rate`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossSpec {
    /// The probability of a drop, 0 to 1.
    pub rate: f64,
    /// The loss generator's seed; `None` derives it from the port's MAC address.
    pub seed: Option<u64>,
}

impl PortKind {
    /// The kind's name, as it starts a spec (`udp`, `afpacket`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            PortKind::Sim => "sim",
            PortKind::Udp(_) => "udp",
            PortKind::AfPacket(_) => "afpacket",
            PortKind::AfXdp { .. } => "afxdp",
            PortKind::Shm { .. } => "shm",
            PortKind::Dpdk { .. } => "dpdk",
        }
    }

    /// Whether the port sends raw Ethernet frames (so that it can carry 802.1Q tags).
    pub fn sends_raw_frames(&self) -> bool {
        matches!(self, PortKind::AfPacket(_) | PortKind::AfXdp { .. } | PortKind::Dpdk { .. })
    }
}

impl From<PortKind> for PortSpec {
    fn from(kind: PortKind) -> PortSpec {
        PortSpec { kind, loss: None, vlan: false }
    }
}

/// The generic options of a spec, taken out of its arguments.
struct Options {
    /// The arguments left for the kind, comma-separated as they were given.
    rest: String,
    loss: Option<LossSpec>,
    vlan: bool,
}

/// Takes `loss=`, `loss_seed=` and `vlan=` out of a spec's comma-separated arguments.
fn take_options(args: &str) -> core::result::Result<Options, String> {
    let (mut rate, mut seed, mut vlan) = (None, None, false);
    let mut rest = Vec::new();
    for part in args.split(',') {
        match part.trim().split_once('=').map(|(k, v)| (k.trim(), v.trim())) {
            Some(("loss", v)) => match v.parse::<f64>() {
                // Adding 0 turns -0 into 0, so that the canonical form has one zero.
                Ok(p) if (0.0..=1.0).contains(&p) => rate = Some(p + 0.0),
                _ => return Err(format!("loss={v}: expected a probability from 0 to 1, e.g. loss=0.01")),
            },
            Some(("loss_seed", v)) => match v.parse::<u64>() {
                Ok(n) => seed = Some(n),
                Err(_) => return Err(format!("loss_seed={v}: expected an unsigned integer")),
            },
            Some(("vlan", "group")) => vlan = true,
            Some(("vlan", v)) => {
                return Err(format!("vlan={v}: write vlan=group (the VLAN ID is the node's group)"))
            }
            _ => rest.push(part),
        }
    }
    let loss = match (rate, seed) {
        (None, Some(_)) => return Err("loss_seed= needs loss=P as well".into()),
        (rate, seed) => rate.map(|rate| LossSpec { rate, seed }),
    };
    Ok(Options { rest: rest.join(","), loss, vlan })
}

impl FromStr for PortSpec {
    type Err = PortError;

    /// Parses a spec (see [`SPEC_HELP`]); surrounding whitespace is ignored. The error is
    /// [`PortError::BadSpec`], naming the part that is wrong and what was expected.
    fn from_str(text: &str) -> Result<PortSpec> {
        let spec = text.trim();
        let (kind, args) = match spec.split_once(':') {
            Some((k, a)) => (k, Some(a)),
            None => (spec, None),
        };
        if !matches!(kind, "sim" | "udp" | "afpacket" | "afxdp" | "shm" | "dpdk") {
            return Err(bad(spec, format!("unknown port kind {kind:?}; one of {KINDS}")));
        }
        let Some(args) = args else {
            return match kind {
                "sim" => Ok(PortKind::Sim.into()),
                "dpdk" => Ok(PortKind::Dpdk { eal_args: Vec::new() }.into()),
                _ => Err(bad(spec, format!("{kind} needs arguments after a colon; see `lanbus --help`"))),
            };
        };
        if kind == "sim" {
            return Err(bad(spec, "sim takes no arguments: write just `sim`"));
        }
        let Options { rest, loss, vlan } = take_options(args).map_err(|why| bad(spec, why))?;
        let kind = match kind {
            "udp" => PortKind::Udp(UdpConfig::parse(&rest).map_err(|why| bad(spec, why))?),
            "afpacket" => PortKind::AfPacket(AfPacketConfig::parse(&rest).map_err(|why| bad(spec, why))?),
            "afxdp" => parse_afxdp(&rest).map_err(|why| bad(spec, why))?,
            "shm" => match rest.trim() {
                "" => return Err(bad(spec, "expected shm:PATH, for example shm:/run/lanbus/a.sock")),
                path => PortKind::Shm { path: PathBuf::from(path) },
            },
            _ => PortKind::Dpdk { eal_args: rest.split_whitespace().map(str::to_string).collect() },
        };
        if vlan && !kind.sends_raw_frames() {
            return Err(bad(
                spec,
                "vlan=group needs a port that sends raw Ethernet frames: afpacket, afxdp or dpdk",
            ));
        }
        Ok(PortSpec { kind, loss, vlan })
    }
}

/// Parses `IFACE[:QUEUE][,xdp=auto|native|generic][,tx=auto|ring]`, the arguments of an afxdp
/// spec.
fn parse_afxdp(args: &str) -> core::result::Result<PortKind, String> {
    let mut parts = args.split(',');
    let place = parts.next().unwrap_or("").trim();
    let (iface, queue) = match place.split_once(':') {
        Some((i, q)) => (i, Some(q)),
        None => (place, None),
    };
    check_ifname(iface)?;
    let queue = match queue {
        Some(q) => q.parse::<u32>().map_err(|_| {
            format!(
                "queue {q:?} is not a receive queue number (0 to 4294967295): write \
                 afxdp:IFACE[:QUEUE][,xdp=auto|native|generic][,tx=auto|ring]"
            )
        })?,
        None => 0,
    };
    let (mut xdp, mut tx) = (XdpModeRequest::Auto, TxRequest::Auto);
    for part in parts {
        match part.trim().split_once('=').map(|(k, v)| (k.trim(), v.trim())) {
            Some(("xdp", "auto")) => xdp = XdpModeRequest::Auto,
            Some(("xdp", "native")) => xdp = XdpModeRequest::Native,
            Some(("xdp", "generic")) => xdp = XdpModeRequest::Generic,
            Some(("tx", "auto")) => tx = TxRequest::Auto,
            Some(("tx", "ring")) => tx = TxRequest::Ring,
            Some(("tx", other)) => {
                return Err(format!(
                    "tx={other:?}: write tx=auto (the default: in copy mode a lone frame goes out \
                     through a plain AF_PACKET send) or tx=ring (every frame through the AF_XDP tx \
                     ring)"
                ))
            }
            Some(("xdp", other)) => {
                return Err(format!(
                    "xdp={other:?}: write xdp=auto (the default: native where the driver can, generic \
                     first on veth), xdp=native (fail without driver support) or xdp=generic"
                ))
            }
            _ => {
                return Err(format!(
                    "unknown afxdp option {part:?}; the options are xdp=auto|native|generic and \
                     tx=auto|ring"
                ))
            }
        }
    }
    Ok(PortKind::AfXdp { ifname: iface.to_string(), queue, xdp, tx })
}

impl fmt::Display for PortSpec {
    /// The canonical spec: the kind, its main argument, its options in a fixed order with the
    /// defaults left out, then `loss=`, `loss_seed=` and `vlan=group`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut args: Vec<String> = Vec::new();
        match &self.kind {
            PortKind::Sim => {}
            PortKind::Udp(c) => {
                args.push(c.bind.to_string());
                for p in &c.peers {
                    if p.mac == derived_mac(p.addr) {
                        args.push(format!("peer={}", p.addr));
                    } else {
                        args.push(format!("peer={}@{}", p.mac, p.addr));
                    }
                }
                args.extend(c.mac.map(|m| format!("mac={m}")));
                args.extend(c.broadcast.map(|b| format!("bcast={b}")));
                args.extend(c.learn.then(|| "learn".to_string()));
                args.extend(c.mtu.map(|m| format!("mtu={m}")));
            }
            PortKind::AfPacket(c) => {
                let default = AfPacketConfig::new(&c.ifname);
                args.push(c.ifname.clone());
                args.extend((c.rx == RxVersion::V3).then(|| "rx=v3".to_string()));
                args.extend((c.tov_ms != default.tov_ms).then(|| format!("tov_ms={}", c.tov_ms)));
                args.extend(c.all_ethertypes.then(|| "ethertypes=all".to_string()));
                args.extend(c.keep_tags.then(|| "tags=keep".to_string()));
            }
            PortKind::AfXdp { ifname, queue, xdp, tx } => {
                args.push(if *queue == 0 { ifname.clone() } else { format!("{ifname}:{queue}") });
                match xdp {
                    XdpModeRequest::Auto => {}
                    XdpModeRequest::Native => args.push("xdp=native".into()),
                    XdpModeRequest::Generic => args.push("xdp=generic".into()),
                }
                if *tx == TxRequest::Ring {
                    args.push("tx=ring".into());
                }
            }
            PortKind::Shm { path } => args.push(path.display().to_string()),
            PortKind::Dpdk { eal_args } => {
                if !eal_args.is_empty() {
                    args.push(eal_args.join(" "));
                }
            }
        }
        if let Some(loss) = self.loss {
            args.push(format!("loss={}", loss.rate));
            args.extend(loss.seed.map(|s| format!("loss_seed={s}")));
        }
        if self.vlan {
            args.push("vlan=group".into());
        }
        f.write_str(self.kind.name())?;
        if !args.is_empty() {
            write!(f, ":{}", args.join(","))?;
        }
        Ok(())
    }
}

impl PortSpec {
    /// Checks what the parser checks, for a spec built by hand; the error says what is wrong.
    fn check(&self) -> core::result::Result<(), String> {
        match &self.kind {
            PortKind::Sim if self.loss.is_some() || self.vlan => {
                return Err("sim takes no arguments: write just `sim`".into())
            }
            PortKind::Sim | PortKind::Dpdk { .. } => {}
            PortKind::Udp(c) => c.validate()?,
            PortKind::AfPacket(c) => {
                check_ifname(&c.ifname)?;
                if !(1..=1000).contains(&c.tov_ms) {
                    return Err(format!("tov_ms={} is not a number of milliseconds in 1..=1000", c.tov_ms));
                }
            }
            PortKind::AfXdp { ifname, .. } => {
                check_ifname(ifname)?;
                if ifname.contains(':') {
                    return Err(format!("{ifname:?} is not an interface name for afxdp (no ':')"));
                }
            }
            PortKind::Shm { path } => {
                if path.as_os_str().is_empty() {
                    return Err("expected shm:PATH, for example shm:/run/lanbus/a.sock".into());
                }
            }
        }
        if let Some(loss) = self.loss {
            if !(0.0..=1.0).contains(&loss.rate) {
                return Err(format!(
                    "loss={}: expected a probability from 0 to 1, e.g. loss=0.01",
                    loss.rate
                ));
            }
        }
        if self.vlan && !self.kind.sends_raw_frames() {
            return Err(
                "vlan=group needs a port that sends raw Ethernet frames: afpacket, afxdp or dpdk".into()
            );
        }
        Ok(())
    }

    /// Opens the port this spec names: the port itself, inside a [`FaultyPort`] when the spec asks
    /// for loss, inside a [`VlanPort`] when it asks for groups as VLANs (outermost). Errors name the
    /// spec in its canonical form: [`PortError::BadSpec`] for a spec built by hand that the parser
    /// would refuse, [`PortError::Unavailable`] (with what to do) when this machine or process
    /// cannot open it.
    pub fn open(&self) -> Result<Box<dyn Port>> {
        let spec = self.to_string();
        self.check().map_err(|why| bad(&spec, why))?;
        // Errors from the port carry the whole spec.
        let whole = |e: PortError| match e {
            PortError::BadSpec { why, .. } => bad(&spec, why),
            PortError::Unavailable { why, .. } => unavailable(&spec, why),
            other => other,
        };
        let port: Box<dyn Port> = match &self.kind {
            // A simulated wire joins two ends inside one process (`SimWire::pair_realtime`), so a
            // spec, which opens one end, cannot name it.
            PortKind::Sim => {
                return Err(unavailable(
                    &spec,
                    "the sim wire is created in-process by `lanbus demo` and the simulator, which hold \
                     both ends; to join two daemons without root, use \
                     udp:127.0.0.1:PORT,peer=127.0.0.1:PORT2",
                ))
            }
            PortKind::Udp(config) => Box::new(UdpPort::open(config).map_err(whole)?),
            PortKind::AfPacket(config) => {
                // AF_PACKET hands a tag over only to a socket that listens to every EtherType.
                let config = AfPacketConfig { keep_tags: config.keep_tags || self.vlan, ..config.clone() };
                Box::new(AfPacketPort::open(&config).map_err(whole)?)
            }
            PortKind::AfXdp { ifname, queue, xdp, tx } => {
                let options = crate::afxdp::AfXdpOptions { xdp_mode: *xdp, tx: *tx, ..Default::default() };
                Box::new(crate::afxdp::open(ifname, *queue, &options).map_err(whole)?)
            }
            PortKind::Shm { path } => {
                let port =
                    crate::shm::ShmPort::open(&format!("shm:{}", path.display())).map_err(|e| match e {
                        PortError::Io { op, source } => unavailable(
                            &spec,
                            format!(
                                "{op} at {}: {source} (the directory must exist and be writable)",
                                path.display()
                            ),
                        ),
                        other => whole(other),
                    })?;
                Box::new(port)
            }
            #[cfg(feature = "dpdk")]
            PortKind::Dpdk { eal_args } => Box::new(
                crate::dpdk::open(&eal_args.join(" "), crate::dpdk::DpdkOptions::default()).map_err(whole)?,
            ),
            #[cfg(not(feature = "dpdk"))]
            PortKind::Dpdk { .. } => {
                return Err(unavailable(
                    &spec,
                    "DPDK support is not built in: rebuild with `--features dpdk` (needs libdpdk-dev)",
                ))
            }
        };
        let port: Box<dyn Port> = match self.loss {
            None => port,
            Some(loss) => {
                let seed = loss.seed.unwrap_or_else(|| {
                    port.mac().0.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
                        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
                    })
                });
                Box::new(FaultyPort::new(port, FaultConfig::loss(loss.rate, seed)))
            }
        };
        Ok(if self.vlan { Box::new(VlanPort::new(port)) } else { port })
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for PortSpec {
    /// The canonical text form.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> core::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for PortSpec {
    /// From the text form (a TOML string, say); the error is the parser's.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> core::result::Result<PortSpec, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// The fuzz target's body: parses arbitrary bytes as a spec (without opening anything). Panics
/// only if the parser does, if an error does not explain itself (an empty message), or if a spec
/// that parses does not come back the same from its canonical form.
#[cfg(any(test, fuzzing))]
pub fn fuzz_spec(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    match text.parse::<PortSpec>() {
        Ok(spec) => {
            let canonical = spec.to_string();
            let again = canonical.parse::<PortSpec>().unwrap_or_else(|e| {
                panic!("{text:?} parsed, but its canonical form {canonical:?} does not: {e}")
            });
            assert_eq!(again, spec, "{text:?} -> {canonical:?}");
            assert_eq!(again.to_string(), canonical, "{text:?}");
        }
        Err(PortError::BadSpec { why, .. }) => assert!(!why.is_empty(), "{text:?}"),
        Err(e) => panic!("{text:?}: parsing gave {e}, not BadSpec"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::udp::UdpPeer;
    use lanbus_wire::MacAddr;
    use proptest::prelude::*;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

    fn parse(spec: &str) -> PortSpec {
        spec.parse().unwrap_or_else(|e| panic!("{spec:?}: {e}"))
    }

    fn err(spec: &str) -> PortError {
        match spec.parse::<PortSpec>().and_then(|s| s.open()) {
            Ok(_) => panic!("{spec:?} opened"),
            Err(e) => e,
        }
    }

    fn afxdp(ifname: &str, queue: u32, xdp: XdpModeRequest, tx: TxRequest) -> PortSpec {
        PortKind::AfXdp { ifname: ifname.into(), queue, xdp, tx }.into()
    }

    #[test]
    fn afxdp_specs_name_a_queue_an_xdp_mode_and_a_transmit_path() {
        let (auto, ring) = (TxRequest::Auto, TxRequest::Ring);
        let ok = |args: &str| parse(&format!("afxdp:{args}"));
        assert_eq!(ok("eth0"), afxdp("eth0", 0, XdpModeRequest::Auto, auto));
        assert_eq!(ok("eth0:3"), afxdp("eth0", 3, XdpModeRequest::Auto, auto));
        assert_eq!(ok("eth0,xdp=generic"), afxdp("eth0", 0, XdpModeRequest::Generic, auto));
        assert_eq!(ok("eth0:1,xdp=native"), afxdp("eth0", 1, XdpModeRequest::Native, auto));
        assert_eq!(ok("eth0,xdp=native,xdp=auto"), afxdp("eth0", 0, XdpModeRequest::Auto, auto));
        assert_eq!(ok(" eth0:2 , xdp = native "), afxdp("eth0", 2, XdpModeRequest::Native, auto));
        assert_eq!(ok("eth0,tx=ring"), afxdp("eth0", 0, XdpModeRequest::Auto, ring));
        assert_eq!(ok("eth0:1,tx=ring,xdp=generic"), afxdp("eth0", 1, XdpModeRequest::Generic, ring));
        assert_eq!(ok("eth0,tx=ring,tx=auto"), afxdp("eth0", 0, XdpModeRequest::Auto, auto));
        assert_eq!(ok("eth0:0,xdp=auto,tx=auto").to_string(), "afxdp:eth0");
        assert_eq!(ok("eth0:1,tx=ring,xdp=generic").to_string(), "afxdp:eth0:1,xdp=generic,tx=ring");
    }

    #[test]
    fn loss_options_come_off_any_spec() {
        let spec = parse("afpacket:eth0, loss = 0.5 ,rx=v3,loss_seed=7");
        assert_eq!(spec.loss, Some(LossSpec { rate: 0.5, seed: Some(7) }));
        let PortKind::AfPacket(c) = &spec.kind else { panic!("{spec:?}") };
        assert_eq!((c.ifname.as_str(), c.rx), ("eth0", RxVersion::V3));
        assert_eq!(spec.to_string(), "afpacket:eth0,rx=v3,loss=0.5,loss_seed=7");
        assert_eq!(parse("udp:127.0.0.1:7,loss=0.01").loss, Some(LossSpec { rate: 0.01, seed: None }));
        assert_eq!(parse("shm:/tmp/a.sock,loss=-0").to_string(), "shm:/tmp/a.sock,loss=0");
        assert_eq!(parse("dpdk:loss=1").to_string(), "dpdk:loss=1");
        assert_eq!(parse("udp:127.0.0.1:7").loss, None);
        for (bad, what) in [
            ("afpacket:eth0,loss=2", "loss=2: expected a probability"),
            ("afpacket:eth0,loss=x", "loss=x"),
            ("afpacket:eth0,loss=-0.1", "loss=-0.1"),
            ("afpacket:eth0,loss=NaN", "loss=NaN"),
            ("afpacket:eth0,loss_seed=1", "needs loss=P"),
            ("afpacket:eth0,loss=0.1,loss_seed=-1", "loss_seed=-1: expected an unsigned integer"),
        ] {
            let e = bad.parse::<PortSpec>().unwrap_err().to_string();
            assert!(e.contains(what), "{bad}: {e}");
        }
    }

    #[test]
    fn the_vlan_option_comes_off_raw_frame_specs_only() {
        let spec = parse("afpacket:eth0,vlan=group,rx=v3");
        assert!(spec.vlan);
        assert_eq!(spec.to_string(), "afpacket:eth0,rx=v3,vlan=group");
        assert!(!parse("afpacket:eth0").vlan);
        assert!(parse("afxdp:eth0:1,vlan=group").vlan);
        assert!(parse("dpdk:-l 1,vlan=group").vlan);
        let e = "afpacket:eth0,vlan=7".parse::<PortSpec>().unwrap_err().to_string();
        assert!(e.contains("vlan=group"), "{e}");
        let e = err("udp:127.0.0.1:1,peer=127.0.0.1:2,vlan=group").to_string();
        assert!(e.contains("raw Ethernet frames"), "{e}");
        let keep = AfPacketConfig::parse("eth0,tags=keep").unwrap();
        assert!(keep.keep_tags && !keep.all_ethertypes);
        assert!(!AfPacketConfig::parse("eth0").unwrap().keep_tags);
        assert!(AfPacketConfig::parse("eth0,tags=drop").unwrap_err().contains("tags=keep"));
    }

    #[test]
    fn udp_specs_write_peers_with_derived_macs_without_them() {
        let text = "udp: 127.0.0.1:7000 ,peer=127.0.0.1:7001,peer=02:00:00:00:00:09@127.0.0.1:7002,\
                    learn,mtu=1400,mac=02:00:00:00:00:01,bcast=127.255.255.255:7000";
        let spec = parse(text);
        assert_eq!(
            spec.to_string(),
            "udp:127.0.0.1:7000,peer=127.0.0.1:7001,peer=02:00:00:00:00:09@127.0.0.1:7002,\
             mac=02:00:00:00:00:01,bcast=127.255.255.255:7000,learn,mtu=1400"
        );
        assert_eq!(parse(&spec.to_string()), spec);
        assert_eq!(parse("udp:[::1]:7000,peer=[::1]:7001").to_string(), "udp:[::1]:7000,peer=[::1]:7001");
        assert_eq!(parse("sim"), PortKind::Sim.into());
        assert_eq!(parse("  dpdk:  -l 1   --no-huge ").to_string(), "dpdk:-l 1 --no-huge");
        assert_eq!(parse("dpdk"), PortKind::Dpdk { eal_args: Vec::new() }.into());
        // Awkward corners that still come back the same from their canonical text.
        for text in [
            "udp:[fe80::1%2]:7000,peer=[fe80::2%2]:7000",
            "udp:[::ffff:1.2.3.4]:7,peer=[::ffff:1.2.3.5]:7",
            "afpacket:eth0:1",
            "afpacket:a=b,loss=1e-9",
            "dpdk:a, loss=0.1 ,b\t,c",
            "dpdk:,vlan=group",
            "shm: /x y ,loss=0",
            "shm:/a,,b",
            "afxdp:e\u{85}:4294967295",
        ] {
            parse(text);
            fuzz_spec(text.as_bytes());
        }
    }

    #[test]
    fn a_spec_built_by_hand_is_checked_when_opened() {
        let mut spec = parse("udp:127.0.0.1:0");
        spec.vlan = true;
        assert!(matches!(spec.open(), Err(PortError::BadSpec { .. })));
        let spec = PortSpec { loss: Some(LossSpec { rate: 1.5, seed: None }), ..parse("udp:127.0.0.1:0") };
        let e = spec.open().err().unwrap().to_string();
        assert!(e.contains("probability"), "{e}");
        let spec: PortSpec = PortKind::AfXdp {
            ifname: "eth0:1".into(),
            queue: 0,
            xdp: XdpModeRequest::Auto,
            tx: TxRequest::Auto,
        }
        .into();
        assert!(matches!(spec.open(), Err(PortError::BadSpec { .. })));
        let spec: PortSpec = PortKind::Shm { path: PathBuf::new() }.into();
        assert!(matches!(spec.open(), Err(PortError::BadSpec { .. })));
    }

    #[test]
    fn a_lossy_port_drops_what_it_receives_and_counts_it() {
        let base = 30_000 + (std::process::id() % 20_000) as u16;
        let (pa, pb) = (base, base + 1);
        let mut a = parse(&format!("udp:127.0.0.1:{pa},peer=127.0.0.1:{pb}")).open().unwrap();
        let mut b =
            parse(&format!("udp:127.0.0.1:{pb},peer=127.0.0.1:{pa},loss=1,loss_seed=3")).open().unwrap();
        let mut frame = [0u8; 60];
        frame[..6].copy_from_slice(&b.mac().0);
        frame[12..14].copy_from_slice(&0x88B5u16.to_be_bytes());
        assert_eq!(a.send_frames(&[&frame, &frame]).unwrap(), 2);
        let t = std::time::Instant::now();
        while b.counters().rx_dropped < 2 && t.elapsed() < core::time::Duration::from_secs(5) {
            assert_eq!(b.rx_burst(8, &mut |_| panic!("a frame got through loss=1")).unwrap(), 0);
        }
        assert_eq!(b.counters().rx_dropped, 2);
        // Sent through the lossy port, every frame is lost too, whichever way it is sent.
        assert_eq!(b.send_frames(&[&frame, &frame]).unwrap(), 0);
        b.tx_borrowed(&[&frame]).unwrap();
        assert_eq!(b.counters().tx_dropped, 3);
        assert_eq!(b.counters().tx_frames, 0);
        assert!(matches!(err("udp:127.0.0.1:0,loss=1.5"), PortError::BadSpec { .. }));
        assert!(matches!(err("udp:127.0.0.1:0,loss_seed=4"), PortError::BadSpec { .. }));
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        let cases: &[(&str, bool, &str)] = &[
            // (spec, is BadSpec (else Unavailable), text in the message)
            ("", true, "unknown port kind"),
            ("ethernet:eth0", true, "unknown port kind"),
            ("udp", true, "needs arguments"),
            ("udp:nonsense", true, "not IP:PORT"),
            ("udp:127.0.0.1:7000,peer=1.2.3", true, "not IP:PORT"),
            ("sim:3", true, "no arguments"),
            ("sim:loss=0.1", true, "no arguments"),
            ("afpacket:", true, "interface name"),
            ("afpacket:this-name-is-far-too-long", true, "15 bytes"),
            ("afxdp:eth0:q", true, "not a receive queue number"),
            ("afxdp:eth0,xdp=fast", true, "xdp=native (fail without driver support)"),
            ("afxdp:eth0:1,mode=native", true, "unknown afxdp option"),
            ("afxdp:eth0,tx=packet", true, "tx=ring (every frame through the AF_XDP tx ring)"),
            ("afxdp:eth0,", true, "unknown afxdp option \"\""),
            ("afxdp:eth0:4294967296", true, "not a receive queue number"),
            ("afxdp:eth0:,xdp=native", true, "not a receive queue number"),
            ("shm:", true, "shm:PATH"),
            ("shm:loss=0.5", true, "shm:PATH"),
            ("sim", false, "created in-process"),
            ("dpdk:-l 1", false, "--features dpdk"),
            ("afxdp:lbnosuchif0", false, "lbnosuchif0"),
            ("shm:/nonexistent-dir/x.sock", false, "nonexistent-dir"),
            ("afpacket:lbnosuchif0", false, "no interface named"),
            ("udp:192.0.2.77:7000", false, "not an address of this machine"),
        ];
        for (spec, is_bad, text) in cases {
            if !*is_bad && spec.starts_with("dpdk") && cfg!(feature = "dpdk") {
                continue;
            }
            let e = err(spec);
            let kind_ok = match &e {
                PortError::BadSpec { spec: s, .. } => *is_bad && s == spec.trim(),
                PortError::Unavailable { spec: s, .. } => !*is_bad && s == spec.trim(),
                _ => false,
            };
            assert!(kind_ok, "{spec:?}: wrong kind of error: {e}");
            assert!(e.to_string().contains(text), "{spec:?}: {e}");
        }
    }

    #[test]
    fn udp_opens_and_address_in_use_is_explained() {
        let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let spec = format!("udp:{}", taken.local_addr().unwrap());
        let e = err(&spec);
        assert!(
            matches!(e, PortError::Unavailable { .. }) && e.to_string().contains("already in use"),
            "{e}"
        );
        // (Not reopened after `taken` closes: a parallel test may get that port meanwhile.)
        let port = parse("udp:127.0.0.1:0").open().expect("a free port opens");
        assert_eq!(port.mtu(), crate::udp::DEFAULT_MTU_V4);
    }

    /// An interface name as the parser takes it (no ':' so that afxdp can hold it too).
    fn ifname() -> impl Strategy<Value = String> {
        "[a-z][a-z0-9_.@-]{0,14}"
    }

    fn unicast_mac() -> impl Strategy<Value = MacAddr> {
        any::<[u8; 6]>().prop_map(|mut b| {
            b[0] &= 0xfe;
            MacAddr(b)
        })
    }

    /// A socket address of the given IP version that a bind or a peer may have (no port 0, no
    /// unspecified address).
    fn socket_addr(v6: bool) -> BoxedStrategy<SocketAddr> {
        if v6 {
            (any::<[u16; 8]>(), 1u16.., 0u32..3)
                .prop_map(|(s, port, scope)| {
                    let ip = Ipv6Addr::from(s);
                    let ip = if ip.is_unspecified() { Ipv6Addr::LOCALHOST } else { ip };
                    SocketAddr::V6(SocketAddrV6::new(ip, port, 0, scope))
                })
                .boxed()
        } else {
            (any::<[u8; 4]>(), 1u16..)
                .prop_map(|(b, port)| {
                    let ip = Ipv4Addr::from(b);
                    let ip = if ip.is_unspecified() { Ipv4Addr::LOCALHOST } else { ip };
                    SocketAddr::new(IpAddr::V4(ip), port)
                })
                .boxed()
        }
    }

    fn udp_config() -> impl Strategy<Value = UdpConfig> {
        any::<bool>().prop_flat_map(|v6| {
            (
                socket_addr(v6),
                proptest::option::of(unicast_mac()),
                proptest::collection::vec((socket_addr(v6), proptest::option::of(unicast_mac())), 0..4),
                proptest::option::of(socket_addr(false)),
                any::<bool>(),
                proptest::option::of(crate::check::MIN_PAYLOAD_BYTES..=crate::udp::MAX_MTU),
            )
                .prop_map(move |(bind, mac, peers, broadcast, learn, mtu)| {
                    let mut config = UdpConfig {
                        mac,
                        broadcast: broadcast.filter(|_| !v6),
                        learn,
                        mtu,
                        ..UdpConfig::new(bind)
                    };
                    for (addr, mac) in peers {
                        let peer = UdpPeer { mac: mac.unwrap_or_else(|| derived_mac(addr)), addr };
                        if peer.addr != bind
                            && config.peers.iter().all(|q| q.addr != peer.addr && q.mac != peer.mac)
                        {
                            config.peers.push(peer);
                        }
                    }
                    config
                })
        })
    }

    fn port_kind() -> impl Strategy<Value = PortKind> {
        let xdp = prop_oneof![
            Just(XdpModeRequest::Auto),
            Just(XdpModeRequest::Native),
            Just(XdpModeRequest::Generic)
        ];
        let tx = prop_oneof![Just(TxRequest::Auto), Just(TxRequest::Ring)];
        prop_oneof![
            Just(PortKind::Sim),
            udp_config().prop_map(PortKind::Udp),
            (ifname(), any::<bool>(), 1u32..=1000, any::<bool>(), any::<bool>()).prop_map(
                |(ifname, v3, tov_ms, all_ethertypes, keep_tags)| {
                    PortKind::AfPacket(AfPacketConfig {
                        rx: if v3 { RxVersion::V3 } else { RxVersion::V2 },
                        tov_ms,
                        all_ethertypes,
                        keep_tags,
                        ..AfPacketConfig::new(&ifname)
                    })
                }
            ),
            (ifname(), prop_oneof![Just(0u32), any::<u32>()], xdp, tx)
                .prop_map(|(ifname, queue, xdp, tx)| PortKind::AfXdp { ifname, queue, xdp, tx }),
            "/[a-zA-Z0-9_./ -]{0,30}[a-z]".prop_map(|p| PortKind::Shm { path: PathBuf::from(p) }),
            proptest::collection::vec("[a-zA-Z0-9_.=,:/-]{1,12}", 0..5)
                .prop_filter("EAL arguments that hold a generic option", |words| {
                    take_options(&words.join(" ")).is_ok_and(|o| o.loss.is_none() && !o.vlan)
                })
                .prop_map(|eal_args| PortKind::Dpdk { eal_args }),
        ]
    }

    fn port_spec() -> impl Strategy<Value = PortSpec> {
        let loss = proptest::option::of((
            prop_oneof![Just(0.0), Just(1.0), 0.0f64..=1.0],
            proptest::option::of(any::<u64>()),
        ));
        (port_kind(), loss, any::<bool>()).prop_map(|(kind, loss, vlan)| PortSpec {
            loss: loss.filter(|_| kind != PortKind::Sim).map(|(rate, seed)| LossSpec { rate, seed }),
            vlan: vlan && kind.sends_raw_frames(),
            kind,
        })
    }

    proptest! {
        #[test]
        fn a_spec_comes_back_the_same_from_its_text(spec in port_spec()) {
            prop_assert_eq!(spec.check(), Ok(()));
            let text = spec.to_string();
            let again = text.parse::<PortSpec>();
            prop_assert!(again.is_ok(), "{:?} -> {:?}: {:?}", spec, text, again);
            let again = again.unwrap();
            prop_assert_eq!(&again, &spec, "{}", text);
            prop_assert_eq!(again.to_string(), text.clone());
            // And so does the text with its arguments spread out with spaces.
            fuzz_spec(text.replace(',', " , ").as_bytes());
        }

        #[test]
        fn random_spec_text_never_panics(text in "(sim|udp|afpacket|afxdp|shm|dpdk|x)?:?[a-z0-9:.,=@\\[\\]/ -]{0,80}") {
            fuzz_spec(text.as_bytes());
        }

        #[test]
        fn random_spec_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..80)) {
            fuzz_spec(&bytes);
        }
    }

    #[test]
    fn help_names_every_kind() {
        for kind in ["sim", "udp:", "afpacket:", "afxdp:", "shm:", "dpdk:"] {
            assert!(SPEC_HELP.contains(kind), "{kind}");
        }
    }
}
