//! Port spec strings: how users name a port on the command line (`--port SPEC`).
//!
//! Layer: ports (the front door). [`open`] turns a spec into an open [`Port`]; [`SPEC_HELP`]
//! documents every spec for `lanbus --help` and the README. A spec is `KIND:ARGS`; errors are
//! [`PortError::BadSpec`] when the string is malformed and [`PortError::Unavailable`] when the port
//! cannot be opened here (not root, no such interface, not built in), each saying what to do.

use crate::afpacket::{AfPacketConfig, AfPacketPort};
use crate::afxdp::{TxRequest, XdpModeRequest};
use crate::udp::{UdpConfig, UdpPort};
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

/// Injected loss asked for with `,loss=P[,loss_seed=N]`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Loss {
    rate: f64,
    seed: Option<u64>,
}

/// Takes the `loss=` and `loss_seed=` options out of a spec's arguments; returns the rest.
fn split_loss(args: &str) -> core::result::Result<(String, Option<Loss>), String> {
    let mut rate = None;
    let mut seed = None;
    let mut rest = Vec::new();
    for part in args.split(',') {
        match part.trim().split_once('=').map(|(k, v)| (k.trim(), v.trim())) {
            Some(("loss", v)) => match v.parse::<f64>() {
                Ok(p) if (0.0..=1.0).contains(&p) => rate = Some(p),
                _ => return Err(format!("loss={v}: expected a probability from 0 to 1, e.g. loss=0.01")),
            },
            Some(("loss_seed", v)) => match v.parse::<u64>() {
                Ok(n) => seed = Some(n),
                Err(_) => return Err(format!("loss_seed={v}: expected an unsigned integer")),
            },
            _ => rest.push(part),
        }
    }
    match (rate, seed) {
        (None, Some(_)) => Err("loss_seed= needs loss=P as well".into()),
        (rate, seed) => Ok((rest.join(","), rate.map(|rate| Loss { rate, seed }))),
    }
}

/// Takes the `vlan=group` option out of a spec's arguments; returns the rest and whether it was
/// there.
fn split_vlan(args: &str) -> core::result::Result<(String, bool), String> {
    let mut vlan = false;
    let mut rest = Vec::new();
    for part in args.split(',') {
        match part.trim().split_once('=').map(|(k, v)| (k.trim(), v.trim())) {
            Some(("vlan", "group")) => vlan = true,
            Some(("vlan", v)) => {
                return Err(format!("vlan={v}: write vlan=group (the VLAN ID is the node's group)"))
            }
            _ => rest.push(part),
        }
    }
    Ok((rest.join(","), vlan))
}

/// Opens the port a spec names (see [`SPEC_HELP`]).
pub fn open(spec: &str) -> Result<Box<dyn Port>> {
    let spec = spec.trim();
    if let Some((kind, args)) = spec.split_once(':') {
        let (rest, vlan) = split_vlan(args).map_err(|why| bad(spec, why))?;
        if vlan {
            if !matches!(kind, "afpacket" | "afxdp" | "dpdk") {
                return Err(bad(
                    spec,
                    "vlan=group needs a port that sends raw Ethernet frames: afpacket, afxdp or dpdk",
                ));
            }
            // AF_PACKET hands a tag over only to a socket that listens to every EtherType.
            let rest = if kind == "afpacket" { format!("{rest},tags=keep") } else { rest };
            let port = open_unvlanned(&format!("{kind}:{rest}")).map_err(|e| match e {
                PortError::BadSpec { why, .. } => bad(spec, why),
                PortError::Unavailable { why, .. } => unavailable(spec, why),
                other => other,
            })?;
            return Ok(Box::new(crate::vlan::VlanPort::new(port)));
        }
    }
    open_unvlanned(spec)
}

/// Opens a spec without the `vlan=` option.
fn open_unvlanned(spec: &str) -> Result<Box<dyn Port>> {
    let (kind, args) = match spec.split_once(':') {
        Some((k, a)) => (k, Some(a)),
        None => (spec, None),
    };
    let Some(args) = args else { return open_plain(spec) };
    let (rest, loss) = split_loss(args).map_err(|why| bad(spec, why))?;
    let Some(loss) = loss else { return open_plain(spec) };
    let port = open_plain(&format!("{kind}:{rest}")).map_err(|e| match e {
        PortError::BadSpec { why, .. } => bad(spec, why),
        PortError::Unavailable { why, .. } => unavailable(spec, why),
        other => other,
    })?;
    let seed = loss.seed.unwrap_or_else(|| {
        port.mac()
            .0
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
    });
    Ok(Box::new(crate::fault::FaultyPort::new(port, crate::fault::FaultConfig::loss(loss.rate, seed))))
}

/// Opens a spec without the loss options.
fn open_plain(spec: &str) -> Result<Box<dyn Port>> {
    let (kind, args) = match spec.split_once(':') {
        Some((k, a)) => (k, Some(a)),
        None => (spec, None),
    };
    // Errors from the port carry the whole spec as the user wrote it.
    let whole = |e: PortError| match e {
        PortError::BadSpec { why, .. } => bad(spec, why),
        PortError::Unavailable { why, .. } => unavailable(spec, why),
        other => other,
    };
    match (kind, args) {
        // A simulated wire joins two ends inside one process (`SimWire::pair_realtime`), so a
        // spec string, which opens one end, cannot name it.
        ("sim", None) => Err(unavailable(
            spec,
            "the sim wire is created in-process by `lanbus demo` and the simulator, which hold both \
             ends; to join two daemons without root, use udp:127.0.0.1:PORT,peer=127.0.0.1:PORT2",
        )),
        ("udp", Some(args)) => {
            let config = UdpConfig::parse(args).map_err(|why| bad(spec, why))?;
            Ok(Box::new(UdpPort::open(&config).map_err(whole)?))
        }
        ("afpacket", Some(args)) => {
            let config = AfPacketConfig::parse(args).map_err(|why| bad(spec, why))?;
            Ok(Box::new(AfPacketPort::open(&config).map_err(whole)?))
        }
        ("afxdp", Some(args)) => {
            let (iface, queue, xdp_mode, tx) = parse_afxdp(spec, args)?;
            let options = crate::afxdp::AfXdpOptions { xdp_mode, tx, ..Default::default() };
            Ok(Box::new(crate::afxdp::open(iface, queue, &options).map_err(whole)?))
        }
        ("shm", Some(path)) => {
            if path.is_empty() {
                return Err(bad(spec, "expected shm:PATH, for example shm:/run/lanbus/a.sock"));
            }
            let port = crate::shm::ShmPort::open(spec).map_err(|e| match e {
                PortError::Io { op, source } => unavailable(
                    spec,
                    format!("{op} at {path}: {source} (the directory must exist and be writable)"),
                ),
                other => whole(other),
            })?;
            Ok(Box::new(port))
        }
        #[cfg(feature = "dpdk")]
        ("dpdk", args) => {
            let port =
                crate::dpdk::open(args.unwrap_or(""), crate::dpdk::DpdkOptions::default()).map_err(whole)?;
            Ok(Box::new(port))
        }
        #[cfg(not(feature = "dpdk"))]
        ("dpdk", _) => Err(unavailable(
            spec,
            "DPDK support is not built in: rebuild with `--features dpdk` (needs libdpdk-dev)",
        )),
        ("sim", Some(_)) => Err(bad(spec, "sim takes no arguments: write just `sim`")),
        ("udp" | "afpacket" | "afxdp" | "shm", None) => {
            Err(bad(spec, format!("{kind} needs arguments after a colon; see `lanbus --help`")))
        }
        _ => {
            Err(bad(spec, format!("unknown port kind {kind:?}; one of sim, udp, afpacket, afxdp, shm, dpdk")))
        }
    }
}

/// The fuzz target's body: parses arbitrary bytes as the arguments of every spec kind that has a
/// parser (without opening anything). Panics only if a parser does; every error must explain
/// itself (a non-empty message).
#[cfg(any(test, fuzzing))]
pub fn fuzz_spec(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Err(why) = UdpConfig::parse(&text) {
        assert!(!why.is_empty());
    }
    if let Err(why) = AfPacketConfig::parse(&text) {
        assert!(!why.is_empty());
    }
    if let Some((_, args)) = text.split_once(':') {
        if let Err(PortError::BadSpec { why, .. }) = parse_afxdp(&text, args) {
            assert!(!why.is_empty());
        }
    }
    match split_loss(&text) {
        Ok((rest, loss)) => {
            assert!(rest.len() <= text.len());
            assert!(loss.is_none_or(|l| (0.0..=1.0).contains(&l.rate)));
        }
        Err(why) => assert!(!why.is_empty()),
    }
    match split_vlan(&text) {
        Ok((rest, _)) => assert!(rest.len() <= text.len()),
        Err(why) => assert!(!why.is_empty()),
    }
}

/// Parses `IFACE[:QUEUE][,xdp=auto|native|generic][,tx=auto|ring]`, the arguments of an afxdp
/// spec.
fn parse_afxdp<'a>(spec: &str, args: &'a str) -> Result<(&'a str, u32, XdpModeRequest, TxRequest)> {
    let mut parts = args.split(',');
    let place = parts.next().unwrap_or("").trim();
    let (iface, queue) = match place.split_once(':') {
        Some((i, q)) => (i, Some(q)),
        None => (place, None),
    };
    crate::afpacket::check_ifname(iface).map_err(|why| bad(spec, why))?;
    let queue = match queue {
        Some(q) => q.parse::<u32>().map_err(|_| {
            bad(
                spec,
                format!(
                    "queue {q:?} is not a receive queue number (0 to 4294967295): write \
                     afxdp:IFACE[:QUEUE][,xdp=auto|native|generic][,tx=auto|ring]"
                ),
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
                return Err(bad(
                    spec,
                    format!(
                        "tx={other:?}: write tx=auto (the default: in copy mode a lone frame goes \
                         out through a plain AF_PACKET send) or tx=ring (every frame through the \
                         AF_XDP tx ring)"
                    ),
                ))
            }
            Some(("xdp", other)) => {
                return Err(bad(
                    spec,
                    format!(
                        "xdp={other:?}: write xdp=auto (the default: native where the driver can, \
                         generic first on veth), xdp=native (fail without driver support) or \
                         xdp=generic"
                    ),
                ))
            }
            _ => {
                return Err(bad(
                    spec,
                    format!(
                        "unknown afxdp option {part:?}; the options are xdp=auto|native|generic and \
                         tx=auto|ring"
                    ),
                ))
            }
        }
    }
    Ok((iface, queue, xdp, tx))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(spec: &str) -> PortError {
        match open(spec) {
            Ok(_) => panic!("{spec:?} opened"),
            Err(e) => e,
        }
    }

    #[test]
    fn afxdp_specs_name_a_queue_an_xdp_mode_and_a_transmit_path() {
        let ok = |args| parse_afxdp("afxdp:...", args).unwrap();
        let (auto, ring) = (TxRequest::Auto, TxRequest::Ring);
        assert_eq!(ok("eth0"), ("eth0", 0, XdpModeRequest::Auto, auto));
        assert_eq!(ok("eth0:3"), ("eth0", 3, XdpModeRequest::Auto, auto));
        assert_eq!(ok("eth0,xdp=generic"), ("eth0", 0, XdpModeRequest::Generic, auto));
        assert_eq!(ok("eth0:1,xdp=native"), ("eth0", 1, XdpModeRequest::Native, auto));
        assert_eq!(ok("eth0,xdp=native,xdp=auto"), ("eth0", 0, XdpModeRequest::Auto, auto));
        assert_eq!(ok(" eth0:2 , xdp = native "), ("eth0", 2, XdpModeRequest::Native, auto));
        assert_eq!(ok("eth0,tx=ring"), ("eth0", 0, XdpModeRequest::Auto, ring));
        assert_eq!(ok("eth0:1,tx=ring,xdp=generic"), ("eth0", 1, XdpModeRequest::Generic, ring));
        assert_eq!(ok("eth0,tx=ring,tx=auto"), ("eth0", 0, XdpModeRequest::Auto, auto));
    }

    #[test]
    fn loss_options_come_off_any_spec() {
        let loss = |rate, seed| Some(Loss { rate, seed });
        assert_eq!(split_loss("eth0").unwrap(), ("eth0".into(), None));
        assert_eq!(split_loss("eth0,loss=0.01").unwrap(), ("eth0".into(), loss(0.01, None)));
        assert_eq!(
            split_loss("eth0, loss = 0.5 ,rx=v3,loss_seed=7").unwrap(),
            ("eth0,rx=v3".into(), loss(0.5, Some(7)))
        );
        for bad in
            ["eth0,loss=2", "eth0,loss=x", "eth0,loss=-0.1", "eth0,loss_seed=1", "eth0,loss=0.1,loss_seed=-1"]
        {
            assert!(!split_loss(bad).unwrap_err().is_empty(), "{bad}");
        }
    }

    #[test]
    fn the_vlan_option_comes_off_raw_frame_specs_only() {
        assert_eq!(split_vlan("eth0,vlan=group,rx=v3").unwrap(), ("eth0,rx=v3".into(), true));
        assert_eq!(split_vlan("eth0").unwrap(), ("eth0".into(), false));
        assert!(split_vlan("eth0,vlan=7").unwrap_err().contains("vlan=group"));
        let err = open("udp:127.0.0.1:1,peer=127.0.0.1:2,vlan=group").err().unwrap().to_string();
        assert!(err.contains("raw Ethernet frames"), "{err}");
        let keep = AfPacketConfig::parse("eth0,tags=keep").unwrap();
        assert!(keep.keep_tags && !keep.all_ethertypes);
        assert!(!AfPacketConfig::parse("eth0").unwrap().keep_tags);
        assert!(AfPacketConfig::parse("eth0,tags=drop").unwrap_err().contains("tags=keep"));
    }

    #[test]
    fn a_lossy_port_drops_what_it_receives_and_counts_it() {
        let base = 30_000 + (std::process::id() % 20_000) as u16;
        let (pa, pb) = (base, base + 1);
        let mut a = open(&format!("udp:127.0.0.1:{pa},peer=127.0.0.1:{pb}")).unwrap();
        let mut b = open(&format!("udp:127.0.0.1:{pb},peer=127.0.0.1:{pa},loss=1,loss_seed=3")).unwrap();
        let mut frame = [0u8; 60];
        frame[..6].copy_from_slice(&b.mac().0);
        frame[12..14].copy_from_slice(&0x88B5u16.to_be_bytes());
        assert_eq!(a.send_frames(&[&frame, &frame]).unwrap(), 2);
        let t = std::time::Instant::now();
        while b.counters().rx_dropped < 2 && t.elapsed() < core::time::Duration::from_secs(5) {
            assert_eq!(b.rx_burst(8, &mut |_| panic!("a frame got through loss=1")).unwrap(), 0);
        }
        assert_eq!(b.counters().rx_dropped, 2);
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
            ("sim", false, "created in-process"),
            ("dpdk:-l 1", false, "--features dpdk"),
            ("afxdp:lbnosuchif0", false, "lbnosuchif0"),
            ("shm:/nonexistent-dir/x.sock", false, "nonexistent-dir"),
            ("afpacket:lbnosuchif0", false, "no interface named"),
            ("udp:192.0.2.77:7000", false, "not an address of this machine"),
        ];
        for (spec, is_bad, text) in cases {
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
        let port = open("udp:127.0.0.1:0").expect("a free port opens");
        assert_eq!(port.mtu(), crate::udp::DEFAULT_MTU_V4);
    }

    proptest::proptest! {
        #[test]
        fn random_spec_text_never_panics(text in "[a-z0-9:.,=@\\[\\]/ -]{0,80}") {
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
