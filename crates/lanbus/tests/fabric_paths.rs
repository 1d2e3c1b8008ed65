//! Two links, one fabric (root): a host and an I/O box in network namespaces of their own, joined
//! by two veth pairs (each end with a MAC of its own), the daemons run with `--port` given once
//! per link.
//!
//! - Both daemons see the other node by both paths (`lanbus status`).
//! - fio `--verify` at queue depth 32 on the remote drive while one link goes down and up ten
//!   times (`ip link set ... down/up`), then with the two links cut in turn: zero errors, the
//!   host never loses the drive, each link's cuts are seen as failovers, and fio's longest I/O
//!   stays under 50 ms.
//!
//! Without root (namespaces, AF_PACKET) it skips and says why.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lanbus_nbd::Client;
use lanbus_port::netns::{check_root, Netns};

mod common;
use common::{lanbus_path, ok, Daemon};

const DRIVE_MIB: u64 = 32;

struct Lab {
    dir: PathBuf,
    host: Netns,
    iobox: Netns,
}

impl Lab {
    fn build(dir: &Path) -> Lab {
        let tag = std::process::id() % 100_000;
        let ns = |what: &str| Netns::create(&format!("lbp{tag}-{what}")).expect("creating a namespace");
        let (host, iobox) = (ns("h"), ns("d"));
        for link in ["eth0", "eth1"] {
            let out = Command::new("ip")
                .args(["link", "add", link, "netns", host.name(), "type", "veth", "peer", "name", link])
                .args(["netns", iobox.name()])
                .output();
            ok(out, "veth");
            for m in [&host, &iobox] {
                ok(m.ip(&["link", "set", link, "mtu", "9000", "up"]), "link up");
            }
        }
        Lab { dir: dir.to_path_buf(), host, iobox }
    }

    fn spawn(&self, ns: &Netns, args: &[String], log: &str) -> Daemon {
        let log = std::fs::File::create(self.dir.join(log)).unwrap();
        Daemon(
            ns.command(lanbus_path()).args(args).stdout(Stdio::null()).stderr(log).spawn().expect("a daemon"),
        )
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    fn status(&self, name: &str) -> serde_json::Value {
        let out = Command::new(lanbus_path())
            .args(["status", "--json", "--control", &self.path(&format!("{name}.ctl"))])
            .output();
        serde_json::from_str(&ok(out, "lanbus status")).expect("status JSON")
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Takes the host's end of `link` down or up (the pair's other end loses its carrier too).
    fn set_link(&self, link: &str, up: bool) {
        ok(self.host.ip(&["link", "set", link, if up { "up" } else { "down" }]), "ip link set");
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for name in ["box", "host"] {
                eprintln!("---- {name}.log\n{}", self.log(name));
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn fio_verify(sock: &str, loops: u32) -> Child {
    Command::new("fio")
        .arg(format!("--loops={loops}"))
        .args(["--name=verify", "--ioengine=nbd", "--rw=randwrite", "--bs=16k", "--iodepth=32"])
        .arg(format!("--uri=nbd+unix:///nvme0?socket={sock}"))
        .arg(format!("--size={DRIVE_MIB}M"))
        .args(["--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0"])
        .args(["--randseed=11", "--output-format=json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running fio (Debian package fio)")
}

/// Waits for fio; its longest write completion (ns) when it passed.
fn passes(fio: Child, what: &str) -> u64 {
    let out = fio.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "fio verify {what} failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let start = text.find('{').expect("fio's JSON");
    let v: serde_json::Value = serde_json::from_str(&text[start..]).expect("fio's JSON");
    v["jobs"][0]["write"]["clat_ns"]["max"].as_f64().unwrap_or(0.0) as u64
}

fn paths_up(status: &serde_json::Value) -> usize {
    status["paths"].as_array().map_or(0, |p| p.iter().filter(|p| p["up"] == true).count())
}

fn failovers(status: &serde_json::Value) -> u64 {
    status["paths"].as_array().map_or(0, |p| p.iter().map(|p| p["failovers"].as_u64().unwrap_or(0)).sum())
}

#[test]
fn a_link_lost_costs_no_io() {
    if let Err(skip) = check_root() {
        eprintln!("skipped: {skip}");
        return;
    }
    if Command::new("fio").arg("--version").output().is_err() {
        panic!("fio is missing: install the Debian package fio (scripts/setup does)");
    }
    let dir = std::env::temp_dir().join(format!("lanbus-paths-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lab = Lab::build(&dir);
    let ports = ["--port", "afpacket:eth0", "--port", "afpacket:eth1"].map(String::from);
    let mut args: Vec<String> = vec!["device".into()];
    args.extend(ports.clone());
    args.extend(["--group".into(), "3".into(), "--nvme".into()]);
    args.push(format!("file={},size={DRIVE_MIB}M", lab.path("disk.img")));
    args.extend(["--control".into(), lab.path("box.ctl")]);
    let _iobox = lab.spawn(&lab.iobox, &args, "box.log");
    let mut args: Vec<String> = vec!["host".into()];
    args.extend(ports);
    args.extend(["--group".into(), "3".into(), "--export".into()]);
    args.push(format!("nbd:{}", lab.path("host.sock")));
    args.extend(["--control".into(), lab.path("host.ctl")]);
    let _host = lab.spawn(&lab.host, &args, "host.log");
    let sock = lab.path("host.sock");
    wait_for("the host's export", Duration::from_secs(30), || {
        Client::connect_unix(Path::new(&sock), "nvme0").is_ok()
    });
    wait_for("both paths, both ways", Duration::from_secs(10), || {
        paths_up(&lab.status("host")) == 2 && paths_up(&lab.status("box")) == 2
    });

    // One link flaps ten times under fio.
    let fio = fio_verify(&sock, 4);
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(150));
        lab.set_link("eth1", false);
        std::thread::sleep(Duration::from_millis(150));
        lab.set_link("eth1", true);
    }
    let longest_one = passes(fio, "with one link flapping");
    let st = lab.status("host");
    assert!(failovers(&st) >= 1, "a cut was seen as a failover: {}", st["paths"]);

    // Then the links cut in turn: always one up.
    let fio = fio_verify(&sock, 4);
    for i in 0..10 {
        let link = if i % 2 == 0 { "eth0" } else { "eth1" };
        std::thread::sleep(Duration::from_millis(150));
        lab.set_link(link, false);
        std::thread::sleep(Duration::from_millis(150));
        lab.set_link(link, true);
    }
    let longest_turns = passes(fio, "with the links cut in turn");
    wait_for("both paths back", Duration::from_secs(5), || paths_up(&lab.status("host")) == 2);
    let st = lab.status("host");
    let paths = st["paths"].as_array().unwrap();
    assert!(
        paths.iter().all(|p| p["failovers"].as_u64().unwrap_or(0) >= 1),
        "each link's cuts were seen: {}",
        st["paths"]
    );
    for (longest, what) in [(longest_one, "one link flapping"), (longest_turns, "the links cut in turn")] {
        assert!(longest < 50_000_000, "fio's longest I/O with {what}: {:.1} ms", longest as f64 / 1e6);
    }
    assert!(!lab.log("host").contains("unexport"), "the host kept the drive:\n{}", lab.log("host"));
    assert!(Client::connect_unix(Path::new(&sock), "nvme0").is_ok(), "the export is still there");
    eprintln!(
        "longest I/O: {:.1} ms with one link flapping, {:.1} ms with the links cut in turn; paths {}",
        longest_one as f64 / 1e6,
        longest_turns as f64 / 1e6,
        st["paths"]
    );
}
