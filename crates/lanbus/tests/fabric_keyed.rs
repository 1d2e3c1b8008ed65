//! A keyed fabric against rogue machines (root): a host, an I/O box and two rogues, each in its
//! own network namespace on a Linux bridge, the daemons run as users run them (`lanbus keygen`,
//! `--key FILE`, SIGHUP for rotation).
//!
//! - A rogue host without the key and one with another key, both started before the real host
//!   in the box's group: neither gets the drive; the real host enumerates and exports it, fio
//!   `--verify` passes, and the wrong-keyed rogue's status and log say the box holds another key.
//! - During fio `--verify`, a rogue without the key takes the real host's MAC and runs a host
//!   daemon (a new epoch, unsealed frames): the box's session stays the real host's, the rogue's
//!   frames are counted as unsealed, no I/O fails.
//! - Frames captured on the bridge are sent to the box again, and altered copies with their
//!   checksums recomputed: the box's layer counts them as replays and bad tags before its
//!   transport sees them, and fio still verifies.
//! - The key rotated in three steps (add, send under, drop), host and box each told by SIGHUP at
//!   its own moment, during fio `--verify` at queue depth 32: zero errors, the new key in use.
//!
//! Without root (namespaces, AF_PACKET) it skips and says why.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use lanbus_nbd::Client;
use lanbus_port::netns::{check_root, Netns};
use lanbus_port::{Port, PortSpec};

const DRIVE_MIB: u64 = 32;

fn lanbus_path() -> &'static str {
    env!("CARGO_BIN_EXE_lanbus")
}

struct Daemon(Child);

impl Daemon {
    fn signal(&self, sig: &str) {
        let _ = Command::new("kill").args([sig, &self.0.id().to_string()]).status();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn ok(out: std::io::Result<Output>, what: &str) -> String {
    let out = out.unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

struct Lab {
    dir: PathBuf,
    switch: Netns,
    host: Netns,
    iobox: Netns,
    rogue: Netns,
    stranger: Netns,
}

impl Lab {
    fn build(dir: &Path) -> Lab {
        let tag = std::process::id() % 100_000;
        let ns = |what: &str| Netns::create(&format!("lbk{tag}-{what}")).expect("creating a namespace");
        let switch = ns("sw");
        ok(switch.ip(&["link", "add", "br0", "type", "bridge"]), "bridge");
        ok(switch.ip(&["link", "set", "br0", "up"]), "bridge up");
        let attach = |m: &Netns, port: &str| {
            let out = Command::new("ip")
                .args(["link", "add", "eth0", "netns", m.name(), "type", "veth", "peer", "name", port])
                .args(["netns", switch.name()])
                .output();
            ok(out, "veth");
            ok(m.ip(&["link", "set", "eth0", "mtu", "9000", "up"]), "eth0 up");
            ok(switch.ip(&["link", "set", port, "mtu", "9000", "master", "br0", "up"]), "switch port up");
        };
        let (host, iobox, rogue, stranger) = (ns("h"), ns("d"), ns("r"), ns("s"));
        attach(&host, "ph");
        attach(&iobox, "pd");
        attach(&rogue, "pr");
        attach(&stranger, "ps");
        Lab { dir: dir.to_path_buf(), switch, host, iobox, rogue, stranger }
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

    fn host(&self, ns: &Netns, name: &str, key: Option<&str>) -> Daemon {
        let mut args: Vec<String> =
            ["host", "--port", "afpacket:eth0", "--group", "7", "--export"].map(String::from).to_vec();
        args.push(format!("nbd:{}", self.path(&format!("{name}.sock"))));
        args.extend(["--control".into(), self.path(&format!("{name}.ctl"))]);
        if let Some(k) = key {
            args.extend(["--key".into(), self.path(k)]);
        }
        self.spawn(ns, &args, &format!("{name}.log"))
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
}

impl Drop for Lab {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for name in ["box", "host", "rogue", "stranger", "impostor"] {
                eprintln!("---- {name}.log\n{}", self.log(name));
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = (&self.switch, &self.stranger);
    }
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn fio_verify(sock: &str, depth: u32, seed: u64) -> Child {
    fio_loops(sock, depth, seed, 1)
}

fn fio_loops(sock: &str, depth: u32, seed: u64, loops: u32) -> Child {
    Command::new("fio")
        .arg(format!("--loops={loops}"))
        .args(["--name=verify", "--ioengine=nbd", "--rw=randwrite", "--bs=16k"])
        .arg(format!("--iodepth={depth}"))
        .arg(format!("--uri=nbd+unix:///nvme0?socket={sock}"))
        .arg(format!("--size={DRIVE_MIB}M"))
        .args(["--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0"])
        .arg(format!("--randseed={seed}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running fio (Debian package fio)")
}

fn passes(fio: Child, what: &str) {
    let out = fio.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "fio verify {what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Sends `frames` a few at a time, so that the receiver's ring (busy with fio's traffic too)
/// takes them all; returns how many the port took.
fn trickle(port: &mut dyn Port, frames: &[&[u8]]) -> usize {
    let mut sent = 0;
    for chunk in frames.chunks(4) {
        sent += port.send_frames(chunk).unwrap();
        std::thread::sleep(Duration::from_micros(500));
    }
    sent
}

fn peer<'a>(status: &'a serde_json::Value, mac: &str) -> &'a serde_json::Value {
    status["security"]["peers"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["mac"] == mac))
        .unwrap_or_else(|| panic!("no peer {mac} in {}", status["security"]))
}

fn counter(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a counter: {v}"))
}

#[test]
fn a_keyed_fabric_keeps_rogues_out() {
    if let Err(skip) = check_root() {
        eprintln!("skipped: {skip}");
        return;
    }
    if Command::new("fio").arg("--version").output().is_err() {
        panic!("fio is missing: install the Debian package fio (scripts/setup does)");
    }
    let dir = std::env::temp_dir().join(format!("lanbus-keyed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lab = Lab::build(&dir);
    let keygen = |file: &str, extra: &[&str]| {
        ok(
            Command::new(lanbus_path()).arg("keygen").args(extra).arg(lab.path(file)).output(),
            "lanbus keygen",
        )
    };
    keygen("box.key", &[]);
    keygen("other.key", &[]);
    std::fs::copy(lab.dir.join("box.key"), lab.dir.join("host.key")).unwrap();

    let iobox = lab.spawn(
        &lab.iobox,
        &[
            "device".into(),
            "--port".into(),
            "afpacket:eth0".into(),
            "--group".into(),
            "7".into(),
            "--nvme".into(),
            format!("file={},size={DRIVE_MIB}M", lab.path("disk.img")),
            "--control".into(),
            lab.path("box.ctl"),
            "--key".into(),
            lab.path("box.key"),
        ],
        "box.log",
    );
    // Two rogues in the box's group, before the real host: one with no key, one with another.
    let rogue = lab.host(&lab.rogue, "rogue", None);
    let stranger = lab.host(&lab.stranger, "stranger", Some("other.key"));
    wait_for("the rogues to be turned away", Duration::from_secs(20), || {
        lab.log("stranger").contains("fabric key this node does not hold")
            && lab.log("box").contains("not sealed")
    });
    let host = lab.host(&lab.host, "host", Some("host.key"));
    let sock = lab.path("host.sock");
    wait_for("the real host's export", Duration::from_secs(30), || {
        Client::connect_unix(Path::new(&sock), "nvme0").is_ok()
    });
    for name in ["rogue", "stranger"] {
        assert!(
            Client::connect_unix(Path::new(&lab.path(&format!("{name}.sock"))), "nvme0").is_err(),
            "{name} got the drive"
        );
    }
    let (host_mac, rogue_mac, stranger_mac) = (
        lab.status("host")["mac"].as_str().unwrap().to_string(),
        lab.status("rogue")["mac"].as_str().unwrap().to_string(),
        lab.status("stranger")["mac"].as_str().unwrap().to_string(),
    );
    let st = lab.status("box");
    assert_eq!(peer(&st, &host_mac)["state"], "authenticated");
    assert!(counter(&peer(&st, &rogue_mac)["rejected"]["unsealed"]) > 0, "{}", st["security"]);
    assert!(counter(&peer(&st, &stranger_mac)["rejected"]["unknown_key"]) > 0, "{}", st["security"]);
    let box_mac = st["mac"].as_str().unwrap().to_string();
    let st = lab.status("stranger");
    assert!(counter(&peer(&st, &box_mac)["rejected"]["unknown_key"]) > 0, "{}", st["security"]);
    assert!(lab.status("rogue")["security"]["mode"] == "open");
    drop((rogue, stranger));
    passes(fio_verify(&sock, 4, 1), "through the keyed fabric");

    // An impostor with the host's MAC and a new epoch, during fio.
    let fio = fio_verify(&sock, 8, 2);
    ok(lab.rogue.ip(&["link", "set", "eth0", "address", &host_mac]), "the impostor's MAC");
    let impostor = lab.host(&lab.rogue, "impostor", None);
    std::thread::sleep(Duration::from_secs(2));
    drop(impostor);
    passes(fio, "with an impostor on the segment");
    let st = lab.status("box");
    assert_eq!(peer(&st, &host_mac)["state"], "authenticated");
    assert!(
        counter(&peer(&st, &host_mac)["rejected"]["unsealed"]) > 0,
        "the impostor's frames: {}",
        st["security"]
    );

    // Replays and altered copies of frames captured on the bridge.
    let fio = fio_verify(&sock, 4, 3);
    let before = lab.status("box");
    let (replayed, altered) = lab
        .switch
        .run(|| {
            let mut capture =
                "afpacket:ph,ethertypes=all".parse::<PortSpec>().unwrap().open().expect("capturing on ph");
            let mut frames: Vec<Vec<u8>> = Vec::new();
            let t = Instant::now();
            while frames.len() < 200 && t.elapsed() < Duration::from_secs(5) {
                capture.rx_burst(32, &mut |f| frames.push(f.to_vec())).unwrap();
            }
            let mut out = "afpacket:pd".parse::<PortSpec>().unwrap().open().expect("sending on pd");
            let unicast: Vec<&Vec<u8>> = frames
                .iter()
                .filter(|f| f[0] & 1 == 0 && f.len() > 60 && f[12..14] == [0x88, 0xb5])
                .collect();
            let replayed = trickle(&mut *out, &unicast.iter().map(|f| f.as_slice()).collect::<Vec<_>>());
            let altered: Vec<Vec<u8>> = unicast
                .iter()
                .map(|f| {
                    let mut f = f.to_vec();
                    let end = 54 + usize::from(u16::from_be_bytes([f[14 + 24], f[14 + 25]]));
                    // A counter never seen (past the replay window) and a flipped payload bit.
                    f[end] ^= 0x40;
                    f[end - 1] ^= 1;
                    f
                })
                .collect();
            let altered = trickle(&mut *out, &altered.iter().map(|f| f.as_slice()).collect::<Vec<_>>());
            (replayed, altered)
        })
        .expect("entering the switch's namespace");
    std::thread::sleep(Duration::from_millis(500));
    let after = lab.status("box");
    passes(fio, "with replayed and altered frames");
    let diff = |what: &str| {
        counter(&after["security"]["rejected"][what]) - counter(&before["security"]["rejected"][what])
    };
    assert!(replayed > 50 && altered > 50, "captured too little: {replayed} {altered}");
    assert!(diff("replay") as usize >= replayed * 9 / 10, "replays counted {} of {replayed}", diff("replay"));
    assert!(
        diff("bad_tag") as usize >= altered * 9 / 10,
        "bad tags counted {} of {altered}",
        diff("bad_tag")
    );

    // Rotation during fio at queue depth 32: each daemon takes each step at its own moment.
    let mut fio = fio_loops(&sock, 32, 4, 30);
    let step = |args: &[&str]| {
        keygen("host.key", args);
        std::fs::copy(lab.dir.join("host.key"), lab.dir.join("box.key")).unwrap();
        host.signal("-HUP");
        std::thread::sleep(Duration::from_millis(150));
        iobox.signal("-HUP");
        std::thread::sleep(Duration::from_millis(150));
    };
    let old = lab.status("box")["security"]["keys"][0].as_str().unwrap().to_string();
    step(&["--add"]);
    let new = lab.status("host")["security"]["keys"][1].as_str().unwrap().to_string();
    step(&["--send", &new]);
    step(&["--drop", &old]);
    assert!(fio.try_wait().unwrap().is_none(), "fio ended before the rotation did: give it more loops");
    passes(fio, "during key rotation");
    for name in ["host", "box"] {
        let st = lab.status(name);
        assert_eq!(st["security"]["keys"], serde_json::json!([new]), "{name}");
        let p = if name == "host" { peer(&st, &box_mac) } else { peer(&st, &host_mac) };
        assert_eq!(p["key"], new.as_str(), "{name}: {}", st["security"]);
    }
    assert!(lab.log("host").contains("keys read again") && lab.log("box").contains("keys read again"));
    drop((host, iobox));
}
