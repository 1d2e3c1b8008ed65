//! Groups as 802.1Q VLANs over a plain Linux bridge (a real L2 switch; this kernel's bridge has
//! no VLAN filtering, so it forwards every tag and the ports' receive filter is what keeps groups
//! apart). Four namespaces on one bridge: two nodes in VLAN 7 (one over afpacket, one over
//! AF_XDP), one in VLAN 8, and an afpacket port without a VLAN that keeps tags, watching the
//! wire and sending untagged frames. Needs root; skips without it.

mod common;

use std::time::{Duration, Instant};

use common::frame;
use lanbus_port::netns::{check_root, Netns};
use lanbus_port::Port;
use lanbus_wire::MacAddr;

const BROADCAST: MacAddr = MacAddr([0xff; 6]);

/// A switch namespace with a bridge and `n` node namespaces, each with `eth0` on it.
struct Switch {
    nodes: Vec<Netns>,
    _switch: Netns,
}

fn switch(n: usize) -> Switch {
    let tag = format!("{:x}", std::process::id());
    let sw = Netns::create(&format!("lanbus-{tag}-vsw")).unwrap();
    sw.ip(&["link", "add", "br0", "type", "bridge"]).unwrap();
    sw.ip(&["link", "set", "br0", "up"]).unwrap();
    let mut nodes = Vec::new();
    for i in 0..n {
        let ns = Netns::create(&format!("lanbus-{tag}-v{i}")).unwrap();
        let port = format!("p{i}");
        let mac = MacAddr([2, 0, 0, 0x76, 0, i as u8 + 1]).to_string();
        sw.ip(&[
            "link",
            "add",
            &port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "address",
            &mac,
            "netns",
            ns.name(),
        ])
        .unwrap();
        sw.ip(&["link", "set", &port, "master", "br0"]).unwrap();
        // The switch hands frames over with their tags in their bytes, as a hardware switch does
        // (a Linux bridge would otherwise leave the tag in the buffer's metadata, where AF_XDP
        // cannot see it; see the afxdp port's notes on VLANs).
        let off = sw.exec("ethtool", &["-K", &port, "txvlan", "off"]).expect("ethtool");
        assert!(off.status.success(), "ethtool: {}", String::from_utf8_lossy(&off.stderr));
        sw.ip(&["link", "set", &port, "up"]).unwrap();
        ns.ip(&["link", "set", "eth0", "up"]).unwrap();
        nodes.push(ns);
    }
    // Carrier and the bridge's forwarding state take a moment.
    std::thread::sleep(Duration::from_millis(300));
    Switch { nodes, _switch: sw }
}

fn open(ns: &Netns, spec: &str) -> Box<dyn Port> {
    let spec = spec.to_string();
    ns.run(move || spec.parse::<lanbus_port::PortSpec>().and_then(|s| s.open()))
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"))
}

fn send(p: &mut dyn Port, f: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let mut once = Some(f.to_vec());
        let sent = p
            .tx_burst(1, &mut |buf| {
                let f = once.take()?;
                buf[..f.len()].copy_from_slice(&f);
                Some(f.len())
            })
            .unwrap();
        if sent == 1 {
            return;
        }
        assert!(Instant::now() < deadline, "could not send");
    }
}

/// What arrives within `wait` (lanbus frames only).
fn receive(p: &mut dyn Port, wait: Duration) -> Vec<Vec<u8>> {
    let deadline = Instant::now() + wait;
    let mut got = Vec::new();
    while Instant::now() < deadline {
        p.rx_burst(64, &mut |f| got.push(f.to_vec())).unwrap();
        p.wait(Some(Duration::from_millis(10))).unwrap();
    }
    got
}

#[test]
fn groups_as_vlans_are_kept_apart_on_a_plain_bridge() {
    if let Err(skip) = check_root() {
        eprintln!("groups_as_vlans_are_kept_apart_on_a_plain_bridge {skip}");
        return;
    }
    let sw = switch(4);
    let mut a = open(&sw.nodes[0], "afpacket:eth0,vlan=group");
    let mut b = open(&sw.nodes[1], "afxdp:eth0,vlan=group");
    let mut c = open(&sw.nodes[2], "afpacket:eth0,vlan=group");
    let mut watch = open(&sw.nodes[3], "afpacket:eth0,tags=keep");
    for (p, vid) in [(&a, 7), (&b, 7), (&c, 8)] {
        p.vlan().expect("a VLAN port").set(vid).unwrap();
    }
    assert!(watch.vlan().is_none());
    assert_eq!(a.mtu(), 1500 - 4, "the tag comes out of the MTU");

    // a -> everyone: b (same VLAN, through AF_XDP) gets it untagged; c (VLAN 8) does not; the
    // wire carries it tagged with VLAN 7.
    let f = frame(BROADCAST, a.mac(), 1, 900);
    send(&mut *a, &f);
    let short = Duration::from_millis(500);
    assert_eq!(receive(&mut *b, short), vec![f.clone()], "same VLAN over AF_XDP");
    assert!(receive(&mut *c, short).is_empty(), "another VLAN");
    let seen = receive(&mut *watch, short);
    assert_eq!(seen.len(), 1);
    assert_eq!(lanbus_port::vlan::frame_vid(&seen[0]), Some(7), "tagged on the wire: {:?}", &seen[0][..20]);
    assert_eq!(&seen[0][16..], &f[12..], "the frame behind the tag");

    // b -> a, unicast, from AF_XDP to afpacket (whose kernel hands the tag over beside the frame).
    let g = frame(a.mac(), b.mac(), 2, 1496 - 14);
    send(&mut *b, &g);
    assert_eq!(receive(&mut *a, short), vec![g], "the longest frame the VLAN port takes");

    // An untagged lanbus frame reaches no VLAN port, and is counted.
    let filtered = a.counters().rx_filtered;
    let untagged = frame(BROADCAST, watch.mac(), 3, 200);
    send(&mut *watch, &untagged);
    assert!(receive(&mut *a, short).is_empty());
    assert!(receive(&mut *c, short).is_empty());
    assert!(a.counters().rx_filtered > filtered, "untagged frames counted as filtered");

    // c moves to VLAN 7 (its group changed) and hears a from then on.
    c.vlan().unwrap().set(7).unwrap();
    let h = frame(BROADCAST, a.mac(), 4, 64);
    send(&mut *a, &h);
    assert_eq!(receive(&mut *c, short), vec![h]);
}
