//! Many machines on one switch (root): five hosts and four I/O boxes, each in its own network
//! namespace, on a Linux bridge; each box an NVMe drive in its own group, every daemon over
//! afpacket with lanbus's own loss injection (0.5% each way at every port, so about 1% of the
//! frames crossing the switch), and a token-bucket qdisc on the switch's ports toward the first
//! box, a real bottleneck.
//!
//! - Every host with a drive runs fio with `--verify=crc32c` through its export, all at once,
//!   while the metrics endpoint is scraped and its counters move.
//! - While the untouched hosts run fio again, box 4 is moved from group 4 to group 5: host 4's
//!   client gets errors (not a hang) and host 5, which had no drive, finds it and verifies it.
//! - Box 2's daemon is killed with SIGKILL: host 2's client gets errors during the outage; once
//!   the daemon is back (a new incarnation) and the drive re-exported, a fresh fio verify passes
//!   and data written and flushed before the kill reads back intact.
//!
//! All of it runs twice: with untagged frames, and with groups carried as 802.1Q VLANs
//! (`vlan=group` on every port; the bridge has no VLAN filtering here, so the ports' own filter
//! keeps the groups apart, and box 4's move to group 5 is a move to VLAN 5).
//!
//! Without root (namespaces, AF_PACKET, tc) it skips and says why.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use lanbus_nbd::Client;
use lanbus_port::netns::{check_root, Netns};

/// Loss each port injects on receive and on transmit.
const LOSS: &str = "0.005";
/// Size of each drive.
const DRIVE_MIB: u64 = 32;

fn lanbus_path() -> &'static str {
    env!("CARGO_BIN_EXE_lanbus")
}

struct Daemon {
    child: Child,
}

impl Daemon {
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One machine: its namespace and where its files go.
struct Machine {
    ns: Netns,
    name: String,
}

struct Fabric {
    dir: PathBuf,
    switch: Netns,
    hosts: Vec<Machine>,
    boxes: Vec<Machine>,
    /// Groups as VLANs.
    vlan: bool,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

fn ok(out: std::io::Result<Output>, what: &str) {
    let out = out.unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
}

impl Fabric {
    fn build(dir: &Path, vlan: bool) -> Fabric {
        let tag = format!("{}{}", std::process::id() % 100_000, if vlan { "v" } else { "" });
        let ns = |what: &str| Netns::create(&format!("lbm{tag}-{what}")).expect("creating a namespace");
        let switch = ns("sw");
        ok(switch.ip(&["link", "add", "br0", "type", "bridge"]), "bridge");
        ok(switch.ip(&["link", "set", "br0", "up"]), "bridge up");
        let attach = |m: &Netns, port: &str| {
            ip(&[
                "link",
                "add",
                "eth0",
                "netns",
                m.name(),
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                switch.name(),
            ]);
            ok(m.ip(&["link", "set", "eth0", "mtu", "9000", "up"]), "eth0 up");
            ok(switch.ip(&["link", "set", port, "mtu", "9000", "master", "br0", "up"]), "switch port up");
        };
        let mut hosts = Vec::new();
        for i in 1..=5 {
            let name = format!("h{i}");
            let m = ns(&name);
            attach(&m, &format!("p{name}"));
            hosts.push(Machine { ns: m, name });
        }
        let mut boxes = Vec::new();
        for i in 1..=4 {
            let name = format!("d{i}");
            let m = ns(&name);
            attach(&m, &format!("p{name}"));
            boxes.push(Machine { ns: m, name });
        }
        // The bottleneck: the switch's ports toward box 1 and its host leave at 400 Mbit/s.
        // (AF_PACKET bypasses the sender's own qdisc; the bridge's ports do not.)
        for port in ["pd1", "ph1"] {
            let tbf = switch
                .command("tc")
                .args(["qdisc", "add", "dev", port, "root", "tbf"])
                .args(["rate", "400mbit", "burst", "64kb", "latency", "5ms"])
                .output();
            ok(tbf, "tbf on the switch's port");
        }
        Fabric { dir: dir.to_path_buf(), switch, hosts, boxes, vlan }
    }

    fn port(&self) -> String {
        let vlan = if self.vlan { ",vlan=group" } else { "" };
        format!("afpacket:eth0,loss={LOSS}{vlan}")
    }

    fn spawn(&self, m: &Machine, args: &[String], log: &str) -> Daemon {
        let log = std::fs::File::create(self.dir.join(log)).unwrap();
        let child =
            m.ns.command(lanbus_path())
                .args(args)
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("starting a daemon");
        Daemon { child }
    }

    fn start_box(&self, i: usize, group: u16, log: &str) -> Daemon {
        let m = &self.boxes[i];
        let d = &self.dir;
        let args = vec![
            "device".into(),
            "--port".into(),
            self.port(),
            "--group".into(),
            group.to_string(),
            "--nvme".into(),
            format!("file={},size={DRIVE_MIB}M", d.join(format!("{}.img", m.name)).display()),
            "--control".into(),
            d.join(format!("{}.ctl", m.name)).display().to_string(),
        ];
        self.spawn(m, &args, log)
    }

    fn start_host(&self, i: usize, group: u16) -> Daemon {
        let m = &self.hosts[i];
        let args = vec![
            "host".into(),
            "--port".into(),
            self.port(),
            "--group".into(),
            group.to_string(),
            "--export".into(),
            format!("nbd:{}", self.sock(i).display()),
            "--control".into(),
            self.dir.join(format!("{}.ctl", m.name)).display().to_string(),
            "--metrics".into(),
            "127.0.0.1:9464".into(),
        ];
        self.spawn(m, &args, &format!("{}.log", m.name))
    }

    fn sock(&self, host: usize) -> PathBuf {
        self.dir.join(format!("{}.sock", self.hosts[host].name))
    }

    /// Scrapes host `i`'s metrics endpoint (inside its namespace) and returns one series' value.
    fn metric(&self, i: usize, series: &'static str) -> f64 {
        let text = self.hosts[i]
            .ns
            .run(|| {
                use std::io::{Read, Write};
                let mut conn = std::net::TcpStream::connect("127.0.0.1:9464").expect("metrics endpoint");
                conn.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
                let mut reply = String::new();
                conn.read_to_string(&mut reply).unwrap();
                reply
            })
            .expect("entering the host's namespace");
        assert!(text.starts_with("HTTP/1.0 200 OK"), "{text}");
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{series} ")))
            .unwrap_or_else(|| panic!("no {series} in {text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        // A failed run shows every daemon's log.
        if std::thread::panicking() {
            let mut logs: Vec<_> = std::fs::read_dir(&self.dir)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "log"))
                .collect();
            logs.sort();
            for log in logs {
                eprintln!("---- {}\n{}", log.display(), std::fs::read_to_string(&log).unwrap_or_default());
            }
        }
        // The namespaces go with their `Netns`; the scratch files here.
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = &self.switch;
    }
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn exported(sock: &Path) -> bool {
    Client::connect_unix(sock, "nvme0").is_ok()
}

/// fio writing `mib` MiB in random 64 KiB blocks and reading every block back against its
/// crc32c, through the export at `sock`.
fn fio_verify(sock: &Path, mib: u64, seed: u64) -> Child {
    Command::new("fio")
        .args(["--name=verify", "--ioengine=nbd", "--rw=randwrite", "--bs=64k", "--iodepth=4"])
        .arg(format!("--uri=nbd+unix:///nvme0?socket={}", sock.display()))
        .arg(format!("--size={mib}M"))
        .args(["--verify=crc32c", "--do_verify=1", "--verify_fatal=1"])
        // No verify state file left in the working directory.
        .arg("--verify_state_save=0")
        .arg(format!("--randseed={seed}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running fio (Debian package fio)")
}

fn passes(fio: Child, what: &str) {
    let out = fio.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for line in
        text.lines().filter(|l| l.trim_start().starts_with("WRITE:") || l.trim_start().starts_with("READ:"))
    {
        eprintln!("{what}: {}", line.trim());
    }
    assert!(
        out.status.success(),
        "fio verify on {what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Reads through `c` until a read fails; the failure must come within `limit` (no hang).
fn errors_within(c: &mut Client, limit: Duration, what: &str) {
    let t = Instant::now();
    let mut buf = vec![0u8; 4096];
    while c.read(0, &mut buf).is_ok() {
        assert!(t.elapsed() < limit, "{what}: reads still succeed after {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(t.elapsed() < limit, "{what}: the failing read took {:?}", t.elapsed());
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed).collect()
}

#[test]
fn five_hosts_and_four_boxes_on_one_switch() {
    if let Err(skip) = check_root() {
        eprintln!("skipped: {skip}");
        return;
    }
    if Command::new("fio").arg("--enghelp=nbd").output().is_err() {
        panic!("fio is missing: the test command installs it (Debian package fio)");
    }
    for vlan in [false, true] {
        eprintln!("== {}", if vlan { "groups as VLANs" } else { "untagged" });
        many_machines(vlan);
    }
}

fn many_machines(vlan: bool) {
    let dir = std::env::temp_dir().join(format!(
        "lanbus-many-{}{}",
        std::process::id(),
        if vlan { "-vlan" } else { "" }
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let f = Fabric::build(&dir, vlan);

    let mut boxes: Vec<Daemon> =
        (0..4).map(|i| f.start_box(i, i as u16 + 1, &format!("d{}.log", i + 1))).collect();
    let _hosts: Vec<Daemon> = (0..5).map(|i| f.start_host(i, i as u16 + 1)).collect();
    for i in 0..4 {
        wait_for(&format!("host {}'s export", i + 1), Duration::from_secs(60), || exported(&f.sock(i)));
    }
    assert!(!f.sock(4).exists(), "host 5's group has no drive yet");

    // Data host 2 writes and flushes before its box is killed.
    let kept = pattern(7, 1 << 20);
    {
        let mut c = Client::connect_unix(&f.sock(1), "nvme0").unwrap();
        c.write(20 << 20, &kept, false).unwrap();
        c.flush().unwrap();
    }

    // Every host with a drive verifies at once; the counters move meanwhile.
    let sent_before = f.metric(0, "lanbus_frames_sent_total");
    let runs: Vec<Child> = (0..4).map(|i| fio_verify(&f.sock(i), 12, i as u64 + 1)).collect();
    for (i, fio) in runs.into_iter().enumerate() {
        passes(fio, &format!("host {}", i + 1));
    }
    assert!(f.metric(0, "lanbus_frames_sent_total") > sent_before, "host 1's frames_sent moves");
    assert!(
        f.metric(0, "lanbus_retransmitted_frames_total") > 0.0,
        "the injected loss shows as retransmissions"
    );
    // Other groups' heartbeats (broadcasts) reach host 1 on an untagged switch; as VLANs, its
    // port filters them out.
    let out = Command::new(lanbus_path())
        .args(["status", "--json", "--control"])
        .arg(dir.join("h1.ctl"))
        .output()
        .expect("lanbus status");
    let st: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status JSON");
    assert_eq!(st["vlan"], if vlan { serde_json::json!(1) } else { serde_json::Value::Null }, "{st}");
    let filtered = f.metric(0, "lanbus_port_rx_filtered_total");
    if vlan {
        assert!(filtered > 0.0, "other VLANs' frames are filtered out at the port");
    } else {
        assert_eq!(filtered, 0.0, "nothing to filter untagged");
    }

    // The untouched hosts verify over and over while box 4 changes group and box 2 dies.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let untouched: Vec<_> = [0usize, 2]
        .into_iter()
        .map(|i| {
            let (sock, stop) = (f.sock(i), stop.clone());
            std::thread::spawn(move || {
                let mut runs = 0;
                // Relaxed: a flag polled between runs; nothing else is published through it.
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    passes(fio_verify(&sock, 8, 20 + runs), &format!("host {} (untouched)", i + 1));
                    runs += 1;
                }
                runs
            })
        })
        .collect();

    let mut c4 = Client::connect_unix(&f.sock(3), "nvme0").unwrap();
    let ctl4 = dir.join("d4.ctl");
    ok(
        Command::new(lanbus_path()).arg("device-ctl").arg(&ctl4).args(["group", "5"]).output(),
        "device-ctl group 5",
    );
    errors_within(&mut c4, Duration::from_secs(30), "host 4 after its drive left the group");
    wait_for("host 5's export of the moved drive", Duration::from_secs(60), || exported(&f.sock(4)));
    passes(fio_verify(&f.sock(4), 8, 5), "host 5 (the moved drive)");

    let mut c2 = Client::connect_unix(&f.sock(1), "nvme0").unwrap();
    boxes[1].kill();
    errors_within(&mut c2, Duration::from_secs(30), "host 2 while its box is down");
    // The host gives the drive up once the box is silent for its liveness time (its requests
    // fail before that): only then can a new export be told from the old one.
    wait_for("host 2's unexport of the dead box", Duration::from_secs(30), || !f.sock(1).exists());
    boxes[1] = f.start_box(1, 2, "d2-restarted.log");
    wait_for("host 2's export after the restart", Duration::from_secs(60), || exported(&f.sock(1)));
    passes(fio_verify(&f.sock(1), 8, 2), "host 2 after its box came back");
    let mut c2 = Client::connect_unix(&f.sock(1), "nvme0").unwrap();
    let mut back = vec![0u8; kept.len()];
    c2.read(20 << 20, &mut back).unwrap();
    assert!(back == kept, "data flushed before the kill reads back intact");

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for (t, host) in untouched.into_iter().zip([1, 3]) {
        let runs = t.join().unwrap_or_else(|_| panic!("a verify on untouched host {host} failed"));
        eprintln!("host {host} (untouched): {runs} verify runs passed during the changes");
        assert!(runs >= 1);
    }
    let log = std::fs::read_to_string(dir.join("h2.log")).unwrap();
    assert!(log.matches("exporting").count() >= 2, "host 2 exported twice:\n{log}");
}
