//! The remote NIC between namespaces (root): a host (`lanbus host --export tap:lanbus0`), an I/O
//! box (`lanbus device --nic tap=nic0`, its TAP bridged to a veth toward a server) and the server,
//! which runs Linux's own TCP; the fabric is a Linux bridge the host and the box reach over
//! afpacket, clean and with lanbus's loss injection (0.5% each way at each port, about 1% of the
//! frames crossing).
//!
//! - ping, iperf3 TCP for 10 s each way (iperf3's own JSON report), and 200 MiB through `nc`
//!   whose sha256 matches, through the remote NIC;
//! - the box moved to another group: the first host's `lanbus0` loses its carrier, the second
//!   host's gets it and carries traffic;
//! - the host and the box joined by a second link through a second bridge (`--port` once per
//!   link): iperf3 each way and the 200 MiB transfer complete, sha256 equal, while the second
//!   link goes down and up again and again.
//!
//! Without root (namespaces, AF_PACKET, TAP) it skips and says why.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lanbus_port::netns::{check_root, Netns};

mod common;
use common::{have, lanbus_path, ok, Daemon, Flapping};

/// Namespaces: a switch, two hosts, the I/O box and the server.
struct Net {
    dir: PathBuf,
    _switch: Netns,
    hosts: [Netns; 2],
    io: Netns,
    server: Netns,
}

const SERVER_IP: &str = "10.77.0.2";

impl Net {
    /// `test` tells two tests of one process apart.
    fn build(dir: &Path, test: char) -> Net {
        let tag = std::process::id() % 100_000;
        let ns = |what: &str| Netns::create(&format!("lbn{tag}{test}-{what}")).expect("creating a namespace");
        let switch = ns("sw");
        ok(switch.ip(&["link", "add", "fab", "type", "bridge"]), "fabric bridge");
        ok(switch.ip(&["link", "set", "fab", "up"]), "fabric up");
        let hosts = [ns("h1"), ns("h2")];
        let io = ns("io");
        let server = ns("srv");
        for (i, m) in [&hosts[0], &hosts[1], &io].into_iter().enumerate() {
            let port = format!("p{i}");
            ok(
                Command::new("ip")
                    .args(["link", "add", "eth0", "netns", m.name(), "type", "veth", "peer", "name", &port])
                    .args(["netns", switch.name()])
                    .output(),
                "fabric veth",
            );
            ok(m.ip(&["link", "set", "eth0", "mtu", "9000", "up"]), "eth0 up");
            ok(switch.ip(&["link", "set", &port, "mtu", "9000", "master", "fab", "up"]), "switch port");
        }
        // The box's wire: a bridge joining its TAP (added once the daemon made it) and a veth to
        // the server.
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
        Net { dir: dir.to_path_buf(), _switch: switch, hosts, io, server }
    }

    /// A second fabric link for host 0 and the box (`eth1` on each) through a second bridge.
    fn add_second_link(&self) {
        ok(self._switch.ip(&["link", "add", "fab1", "type", "bridge"]), "second bridge");
        ok(self._switch.ip(&["link", "set", "fab1", "up"]), "second bridge up");
        for (m, port) in [(&self.hosts[0], "q0"), (&self.io, "q2")] {
            ok(
                Command::new("ip")
                    .args(["link", "add", "eth1", "netns", m.name(), "type", "veth", "peer", "name", port])
                    .args(["netns", self._switch.name()])
                    .output(),
                "second veth",
            );
            ok(m.ip(&["link", "set", "eth1", "mtu", "9000", "up"]), "eth1 up");
            ok(self._switch.ip(&["link", "set", port, "mtu", "9000", "master", "fab1", "up"]), "switch port");
        }
    }

    fn spawn(&self, ns: &Netns, args: &[String], log: &str) -> Daemon {
        let log = std::fs::File::create(self.dir.join(log)).unwrap();
        Daemon(
            ns.command(lanbus_path()).args(args).stdout(Stdio::null()).stderr(log).spawn().expect("daemon"),
        )
    }

    fn start_box(&self, port: &str, group: u16) -> Daemon {
        self.start_box_with(port, group, &[])
    }

    fn start_box_with(&self, port: &str, group: u16, extra: &[String]) -> Daemon {
        let mut args: Vec<String> = [
            "device",
            "--port",
            port,
            "--group",
            &group.to_string(),
            "--nic",
            "tap=nic0,mac=02:00:00:77:00:01",
            "--control",
            &self.dir.join("io.ctl").display().to_string(),
        ]
        .map(String::from)
        .to_vec();
        args.extend_from_slice(extra);
        let d = self.spawn(&self.io, &args, "io.log");
        wait_for("the box's TAP", || self.io.ip(&["link", "show", "nic0"]).is_ok());
        ok(self.io.ip(&["link", "set", "nic0", "master", "br0", "up"]), "TAP into the box's bridge");
        d
    }

    fn start_host(&self, i: usize, port: &str, group: u16) -> Daemon {
        self.start_host_with(i, port, group, &[])
    }

    fn start_host_with(&self, i: usize, port: &str, group: u16, extra: &[String]) -> Daemon {
        let mut args: Vec<String> = [
            "host",
            "--port",
            port,
            "--group",
            &group.to_string(),
            "--export",
            "tap:lanbus0",
            "--control",
            &self.ctl(i).display().to_string(),
        ]
        .map(String::from)
        .to_vec();
        args.extend_from_slice(extra);
        self.spawn(&self.hosts[i], &args, &format!("h{i}.log"))
    }

    fn ctl(&self, i: usize) -> PathBuf {
        self.dir.join(format!("h{i}.ctl"))
    }

    /// Whether host `i`'s `lanbus0` has its carrier.
    fn carrier(&self, i: usize) -> bool {
        self.hosts[i]
            .ip(&["link", "show", "lanbus0"])
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("LOWER_UP"))
    }

    /// Waits for host `i`'s NIC and gives it `addr`.
    fn up(&self, i: usize, addr: &str) {
        wait_for("the host's NIC", || self.carrier(i));
        ok(self.hosts[i].ip(&["addr", "add", &format!("{addr}/24"), "dev", "lanbus0"]), "host address");
    }

    fn ping(&self, i: usize) {
        ok(
            self.hosts[i].exec("ping", &["-c", "3", "-i", "0.2", "-W", "2", SERVER_IP]),
            "ping through the remote NIC",
        );
    }

    /// iperf3 for 10 s (`reverse`: the server sends); the received rate in bit/s.
    fn iperf3(&self, i: usize, reverse: bool) -> f64 {
        let mut server =
            self.server.command("iperf3").args(["-s", "-1"]).stdout(Stdio::null()).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let mut args = vec!["-c", SERVER_IP, "-t", "10", "--json", "--connect-timeout", "5000"];
        if reverse {
            args.push("-R");
        }
        let out = ok(self.hosts[i].exec("iperf3", &args), "iperf3");
        let _ = server.wait();
        let v: serde_json::Value = serde_json::from_str(&out).expect("iperf3's JSON");
        let bps = v["end"]["sum_received"]["bits_per_second"].as_f64().expect("iperf3's received rate");
        let bytes = v["end"]["sum_received"]["bytes"].as_f64().unwrap_or(0.0);
        assert!(bps > 0.0 && bytes > 0.0, "iperf3 moved nothing: {out}");
        bps
    }

    /// 200 MiB from the host to the server through `nc`; the server's sha256 must match.
    fn transfer(&self, i: usize, file: &Path, sum: &str) {
        let got = self.dir.join("got.sha256");
        let _ = std::fs::remove_file(&got);
        let mut server = self
            .server
            .command("sh")
            .args(["-c", &format!("nc -l 5001 | sha256sum > {}", got.display())])
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        ok(
            self.hosts[i]
                .command("sh")
                .args(["-c", &format!("nc -N {SERVER_IP} 5001 < {}", file.display())])
                .output(),
            "nc to the server",
        );
        let _ = server.wait();
        let got = std::fs::read_to_string(&got).unwrap();
        assert_eq!(got.split_whitespace().next(), Some(sum), "the server received the bytes sent");
    }
}

/// 200 MiB of random bytes in `dir`, and their sha256.
fn random_file(dir: &Path) -> (PathBuf, String) {
    let file = dir.join("200M.bin");
    ok(
        Command::new("dd")
            .args(["if=/dev/urandom", &format!("of={}", file.display()), "bs=1M", "count=200", "status=none"])
            .output(),
        "a 200 MiB file",
    );
    let sum = ok(Command::new("sha256sum").arg(&file).output(), "sha256sum");
    let sum = sum.split_whitespace().next().unwrap().to_string();
    (file, sum)
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn skip() -> bool {
    if let Err(s) = check_root() {
        eprintln!("{s}");
        return true;
    }
    for p in ["iperf3", "nc", "ping", "sha256sum"] {
        if !have(p) {
            eprintln!("skipped: needs {p} (scripts/setup installs it)");
            return true;
        }
    }
    if !Path::new("/dev/net/tun").exists() {
        eprintln!("skipped: needs /dev/net/tun (TAP interfaces)");
        return true;
    }
    false
}

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lanbus-nic-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn ping_iperf3_and_200_mib_cross_the_remote_nic_clean_and_lossy() {
    if skip() {
        return;
    }
    let dir = tempdir("traffic");
    let net = Net::build(&dir, 't');
    let (file, sum) = random_file(&dir);
    // The third run: a keyed fabric whose payloads are encrypted, over the lossy port.
    let key = dir.join("fabric.key");
    ok(Command::new(lanbus_path()).arg("keygen").arg(&key).output(), "lanbus keygen");
    let keyed = ["--key".to_string(), key.display().to_string(), "--encrypt".to_string()];
    for (port, extra) in [
        ("afpacket:eth0", &[][..]),
        ("afpacket:eth0,loss=0.005", &[][..]),
        ("afpacket:eth0,loss=0.005", &keyed[..]),
    ] {
        let _io = net.start_box_with(port, 1, extra);
        let host = net.start_host_with(0, port, 1, extra);
        net.up(0, "10.77.0.1");
        net.ping(0);
        let up = net.iperf3(0, false);
        let down = net.iperf3(0, true);
        eprintln!(
            "{port} {extra:?}: iperf3 {:.2} Gbit/s host to server, {:.2} server to host",
            up / 1e9,
            down / 1e9
        );
        net.transfer(0, &file, &sum);
        let status = ok(
            Command::new(lanbus_path()).args(["status", "--json", "--control"]).arg(net.ctl(0)).output(),
            "lanbus status",
        );
        let v: serde_json::Value = serde_json::from_str(&status).unwrap();
        assert!(v["nic"]["tx_bytes"].as_u64().unwrap() > 200 << 20, "{v}");
        assert_eq!(v["nic"]["mac"], "02:00:00:77:00:01", "the TAP has the device's MAC");
        if !extra.is_empty() {
            let s = &v["security"];
            assert_eq!(
                (&s["mode"], &s["peers"][0]["state"]),
                (&"encrypt".into(), &"authenticated".into()),
                "{s}"
            );
            assert_eq!(s["rejected"]["bad_tag"], 0, "{s}");
        }
        drop(host);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_nic_follows_its_box_to_another_group() {
    if skip() {
        return;
    }
    let dir = tempdir("group");
    let net = Net::build(&dir, 'g');
    let port = "afpacket:eth0";
    let _io = net.start_box(port, 1);
    let _h1 = net.start_host(0, port, 1);
    let _h2 = net.start_host(1, port, 2);
    net.up(0, "10.77.0.1");
    net.ping(0);
    assert!(!net.carrier(1), "the second host has no NIC yet");
    ok(
        Command::new(lanbus_path())
            .args(["device-ctl"])
            .arg(net.dir.join("io.ctl"))
            .args(["group", "2"])
            .output(),
        "moving the box",
    );
    wait_for("the first host's carrier to go", || !net.carrier(0));
    net.up(1, "10.77.0.3");
    net.ping(1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn iperf3_and_200_mib_cross_the_remote_nic_over_two_links_while_one_flaps() {
    if skip() {
        return;
    }
    let dir = tempdir("two-links");
    let net = Net::build(&dir, 'p');
    net.add_second_link();
    let (file, sum) = random_file(&dir);
    let second = ["--port".to_string(), "afpacket:eth1".to_string()];
    let _io = net.start_box_with("afpacket:eth0", 1, &second);
    let _host = net.start_host_with(0, "afpacket:eth0", 1, &second);
    net.up(0, "10.77.0.1");
    net.ping(0);
    let flapping = Flapping::start(net.hosts[0].name(), "eth1", Duration::from_millis(200));

    let up = net.iperf3(0, false);
    let down = net.iperf3(0, true);
    net.transfer(0, &file, &sum);
    let flaps = flapping.stop();
    let status = ok(
        Command::new(lanbus_path()).args(["status", "--json", "--control"]).arg(net.ctl(0)).output(),
        "lanbus status",
    );
    let v: serde_json::Value = serde_json::from_str(&status).unwrap();
    let failovers: u64 =
        v["paths"].as_array().map_or(0, |p| p.iter().map(|p| p["failovers"].as_u64().unwrap_or(0)).sum());
    eprintln!(
        "two links, eth1 flapping {flaps} times: iperf3 {:.2} Gbit/s host to server, {:.2} server to host, \
         {failovers} failovers",
        up / 1e9,
        down / 1e9
    );
    assert!(flaps >= 10, "the link flapped {flaps} times");
    assert!(failovers >= 1, "the cuts were seen: {}", v["paths"]);
    let _ = std::fs::remove_dir_all(&dir);
}
