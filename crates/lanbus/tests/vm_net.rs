//! A real guest on the remote NIC (root): `lanbus device --nic` in an I/O box namespace, its
//! TAP bridged to a veth toward a server namespace; `lanbus host --export vhost-user-net:...`
//! in a host namespace, joined to the box by a veth (afpacket); QEMU's virtio-net-pci on the
//! host's socket, driven by the guest kernel's own virtio_net (`scripts/guest`).
//!
//! - the guest sets its address, pings the server, fetches a 50 MiB file from python's
//!   http.server and posts it back to a server that answers its sha256: both checksums match
//!   the file's;
//! - a VMM killed in the middle of a transfer leaves the backend serving: the next guest pings;
//! - the I/O box stopping unexports the NIC: the socket goes away.
//!
//! Skips, saying why, without root, QEMU or busybox-static.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lanbus_port::netns::{Netns, VethPair};

mod common;
use common::guest::{self, Guest};
use common::{have, lanbus_path, ok, Daemon};

const GUEST_IP: &str = "10.78.0.5";
const SERVER_IP: &str = "10.78.0.2";
const MAC: &str = "02:00:00:78:00:01";
const FILE_MIB: usize = 50;
/// How long a guest may take from boot to power-off (TCG moves some tens of MB/s).
const LIMIT: Duration = Duration::from_secs(240);

const WORKLOAD: &str = r#"#!/bin/sh
# lanbus.cmd=MODE,GUEST_IP,SERVER_IP: ping, or transfer (fetch the file, post it back)
mode=$1 ip=$2 server=$3
i=0
while ! ip link show eth0 >/dev/null 2>&1 && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
ip link set eth0 up || exit 3
ip addr add "$ip/24" dev eth0 || exit 3
echo "eth0 $(cat /sys/class/net/eth0/address) mtu $(cat /sys/class/net/eth0/mtu)"
ping -c 3 -W 5 "$server" || exit 4
[ "$mode" = ping ] && exit 0
echo "lanbus-guest: fetching"
wget -q -O /tmp/f "http://$server:8000/file" || exit 5
echo "fetched sha256=$(sha256sum /tmp/f | cut -d' ' -f1)"
wget -q -O /tmp/answer --post-file /tmp/f "http://$server:8001/" || exit 6
echo "posted sha256=$(cat /tmp/answer)"
"#;

/// Answers each POST with the sha256 of its body.
const HASH_SERVER: &str = r#"
import hashlib, http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        left, h = int(self.headers["Content-Length"]), hashlib.sha256()
        while left:
            b = self.rfile.read(min(left, 1 << 20))
            if not b:
                break
            h.update(b)
            left -= len(b)
        body = h.hexdigest().encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("0.0.0.0", 8001), H).serve_forever()
"#;

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `n` bytes of a seeded pattern (xorshift), none of them zero: busybox's wget takes a posted
/// file's length with `strlen`.
fn pattern(n: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 24) % 255) as u8 + 1
        })
        .collect()
}

fn host_status(control: &std::path::Path) -> serde_json::Value {
    let out =
        Command::new(lanbus_path()).args(["status", "--json", "--control"]).arg(control).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_guest_moves_a_file_both_ways_through_the_remote_nic_and_a_killed_vmm_leaves_it_serving() {
    if let Some(why) = guest::skip_reason() {
        eprintln!("{why}");
        return;
    }
    if !have("python3") {
        eprintln!("skipped: needs python3 for the guest's servers");
        return;
    }
    let dir: PathBuf = std::env::temp_dir().join(format!("lanbus-vmnet-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("www")).unwrap();
    let data = pattern(FILE_MIB << 20);
    std::fs::write(dir.join("www/file"), &data).unwrap();
    drop(data);
    let want = ok(Command::new("sha256sum").arg(dir.join("www/file")).output(), "sha256sum");
    let want = want.split_whitespace().next().unwrap().to_string();

    let socket = dir.join("net0.sock");
    let devices = [
        "-chardev".to_string(),
        format!("socket,id=n0,path={},reconnect=1", socket.display()),
        "-netdev".to_string(),
        "vhost-user,id=net0,chardev=n0".to_string(),
        "-device".to_string(),
        format!("virtio-net-pci,netdev=net0,mac={MAC},vectors=0"),
    ];
    let mut guest = Guest::build(&dir, WORKLOAD, &[], devices.to_vec());
    // The fetched file and the copy wget posts live in the guest's RAM.
    guest.mem_mib = 384;

    // The box and the server: the box's TAP and a veth to the server in one bridge.
    let veth = VethPair::create().expect("namespaces");
    let (io, host) = (&veth.a.netns, &veth.b.netns);
    let server =
        Netns::create(&format!("lbvn{}-srv", std::process::id() % 100_000)).expect("server namespace");
    ok(io.ip(&["link", "add", "br0", "type", "bridge"]), "box bridge");
    ok(
        Command::new("ip")
            .args(["link", "add", "wire", "netns", io.name(), "type", "veth", "peer", "name", "eth0"])
            .args(["netns", server.name()])
            .output(),
        "server veth",
    );
    ok(io.ip(&["link", "set", "wire", "master", "br0", "up"]), "wire up");
    ok(io.ip(&["link", "set", "br0", "up"]), "box bridge up");
    ok(server.ip(&["addr", "add", &format!("{SERVER_IP}/24"), "dev", "eth0"]), "server address");
    ok(server.ip(&["link", "set", "eth0", "up"]), "server up");
    ok(server.ip(&["link", "set", "lo", "up"]), "server lo");

    let spawn = |ns: &Netns, args: &[String], log: &str| {
        let log = std::fs::File::create(dir.join(log)).unwrap();
        Daemon(
            ns.command(lanbus_path()).args(args).stdout(Stdio::null()).stderr(log).spawn().expect("daemon"),
        )
    };
    let s = |x: &str| x.to_string();
    let (io_ctl, host_ctl) = (dir.join("io.ctl"), dir.join("host.ctl"));
    let device = spawn(
        io,
        &[
            s("device"),
            s("--port"),
            format!("afpacket:{}", veth.a.ifname),
            s("--group"),
            s("6"),
            s("--nic"),
            format!("tap=nic0,mac={MAC}"),
            s("--control"),
            io_ctl.display().to_string(),
        ],
        "io.log",
    );
    wait_for("the box's TAP", Duration::from_secs(30), || {
        io.ip(&["link", "show", "nic0"]).is_ok_and(|o| o.status.success())
    });
    ok(io.ip(&["link", "set", "nic0", "master", "br0", "up"]), "TAP into the box's bridge");
    let _host = spawn(
        host,
        &[
            s("host"),
            s("--port"),
            format!("afpacket:{}", veth.b.ifname),
            s("--group"),
            s("6"),
            s("--export"),
            format!("vhost-user-net:{}", socket.display()),
            s("--control"),
            host_ctl.display().to_string(),
        ],
        "host.log",
    );
    wait_for("the vhost-user-net socket", Duration::from_secs(30), || socket.exists());

    let www = dir.join("www");
    let _files = Daemon(
        server
            .command("python3")
            .args(["-m", "http.server", "8000", "--bind", SERVER_IP, "--directory"])
            .arg(&www)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let _hashes = Daemon(
        server
            .command("python3")
            .args(["-c", HASH_SERVER])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    std::thread::sleep(Duration::from_millis(500));

    let cmd = |mode: &str| format!("{mode},{GUEST_IP},{SERVER_IP}");
    let first = guest.boot(&cmd("transfer"), "transfer", LIMIT);
    let st = host_status(&host_ctl);
    eprintln!("host after the transfer: {:#}", st["nic"]);
    assert!(first.contains(&format!("eth0 {MAC} mtu 1500")), "{first}");
    assert!(first.contains("lanbus-guest: exit 0"), "{first}");
    assert!(first.contains(&format!("fetched sha256={want}")), "the guest fetched the file intact: {first}");
    assert!(
        first.contains(&format!("posted sha256={want}")),
        "the server got the guest's copy intact: {first}"
    );

    let v = &st["nic"]["vhost_user_net"];
    assert!(v["rx_bytes"].as_u64().unwrap() >= (FILE_MIB as u64) << 20, "{st}");
    assert!(v["tx_bytes"].as_u64().unwrap() >= (FILE_MIB as u64) << 20, "{st}");
    assert_eq!(v["tx_dropped"].as_u64().unwrap(), 0, "{st}");
    assert_eq!(v["protocol_errors"].as_u64().unwrap(), 0, "{st}");

    // A VMM killed while its guest fetches: the backend takes the next one.
    let log = dir.join("killed.log");
    let mut q = guest.qemu(&cmd("transfer"), &log);
    let before = host_status(&host_ctl)["nic"]["vhost_user_net"]["rx_bytes"].as_u64().unwrap();
    wait_for("the killed guest's traffic", Duration::from_secs(120), || {
        host_status(&host_ctl)["nic"]["vhost_user_net"]["rx_bytes"].as_u64().unwrap() > before + (4 << 20)
    });
    q.0.kill().unwrap();
    q.0.wait().unwrap();
    let third = guest.boot(&cmd("ping"), "after-kill", LIMIT);
    assert!(third.contains("lanbus-guest: exit 0"), "{third}");
    let v = &host_status(&host_ctl)["nic"]["vhost_user_net"];
    assert!(v["connections"].as_u64().unwrap() >= 3, "{v}");

    // The I/O box goes: the host unexports the NIC and its socket goes with it.
    drop(device);
    wait_for("the unexport", Duration::from_secs(30), || !socket.exists());
    let _ = std::fs::remove_dir_all(&dir);
}
