//! A real guest on the remote drive (root): `lanbus device` (NVMe in RAM) and `lanbus host
//! --export vhost-user-blk:...` in two namespaces joined by a veth (afpacket), QEMU's
//! vhost-user-blk-pci on the host's socket, and a Debian kernel with a busybox initramfs
//! (`scripts/guest`) whose workload is a small static pattern tool (`tests/vm/pattern.rs`).
//!
//! - the guest writes a seeded 64 MiB pattern to /dev/vda and prints its checksum, equal to the
//!   same tool's on a local file; it powers off; a second guest reads the 64 MiB back: same
//!   checksum, every MiB as written;
//! - the NBD export beside it (the same driver) reads the guest's last 4 MiB as written;
//! - a guest killed in the middle of writing leaves the backend serving: the next guest writes,
//!   drops its cache and reads back 8 MiB correctly, discards one MiB (blkdiscard) and zeroes
//!   another (BLKZEROOUT), which reaches the backend as DISCARD and WRITE_ZEROES and reads back
//!   as zero.
//!
//! - the host daemon restarting under a running guest (QEMU's `reconnect=1`): what the guest
//!   wrote before reads back through the new daemon; and the host daemon killed (SIGKILL) while
//!   a guest writes: QEMU hands the new daemon the requests it had not seen completed (from the
//!   used index: the backend publishes completions in the order it took the requests), and the
//!   guest reads back every MiB as written;
//! - the I/O box stopping unexports the drive: the socket goes away.
//!
//! Skips, saying why, without root, QEMU, busybox-static or rustc (to build the pattern tool).
//! QEMU runs with TCG unless LANBUS_GUEST_ACCEL says otherwise (`kvm` where it works).

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lanbus_port::netns::VethPair;

mod common;
use common::guest::{self, Guest};
use common::{have, lanbus_path, Daemon as Proc};

/// How long a guest may take from boot to power-off.
const LIMIT: Duration = Duration::from_secs(120);

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

const WORKLOAD: &str = r#"#!/bin/sh
# lanbus.cmd=MODE,SEED,MIB: write, read, or rw (write, drop the page cache, read back; then
# discard the last MiB, zero the one before it and read the rest back)
mode=$1 seed=$2 mib=$3
i=0
while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
[ -b /dev/vda ] || { echo "no /dev/vda"; exit 3; }
echo "vda serial=$(cat /sys/block/vda/serial) sectors=$(cat /sys/block/vda/size) queues=$(ls /sys/block/vda/mq | wc -l) ro=$(cat /sys/block/vda/ro)"
case $mode in
  write|read) /bin/pattern "$mode" "$seed" "$mib" /dev/vda ;;
  rw)
    /bin/pattern write "$seed" "$mib" /dev/vda || exit 1
    echo 3 >/proc/sys/vm/drop_caches
    /bin/pattern read "$seed" "$mib" /dev/vda || exit 1
    blkdiscard -o $(((mib - 1) << 20)) -l 1048576 /dev/vda || exit 4
    /bin/pattern zero $((mib - 2)) 1 /dev/vda || exit 5
    echo 3 >/proc/sys/vm/drop_caches
    /bin/pattern read "$seed" $((mib - 2)) /dev/vda
    ;;
  busy)
    # write while the test kills and restarts the backend, then read back
    /bin/pattern write "$seed" "$mib" /dev/vda || exit 1
    echo 3 >/proc/sys/vm/drop_caches
    /bin/pattern read "$seed" "$mib" /dev/vda
    ;;
  pause)
    # write, wait while the test restarts the backend, read back through the new one
    /bin/pattern write "$seed" "$mib" /dev/vda || exit 1
    echo "lanbus-guest: paused"
    sleep 12
    echo 3 >/proc/sys/vm/drop_caches
    /bin/pattern read "$seed" "$mib" /dev/vda
    ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
"#;

/// The `checksum=` and `mismatches=` of the pattern tool's last report in `text`.
fn report(text: &str) -> (String, u64) {
    let line = text
        .lines()
        .rev()
        .find(|l| l.contains("checksum="))
        .unwrap_or_else(|| panic!("no pattern report in:\n{text}"));
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.trim().strip_prefix(k))
            .unwrap_or_else(|| panic!("no {k} in {line}"))
            .to_string()
    };
    (field("checksum="), field("mismatches=").parse().unwrap())
}

fn host_status(control: &Path) -> serde_json::Value {
    let out =
        Command::new(lanbus_path()).args(["status", "--json", "--control"]).arg(control).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_guest_writes_and_reads_back_the_remote_drive_and_a_killed_vmm_leaves_it_serving() {
    if let Some(why) = guest::skip_reason() {
        eprintln!("{why}");
        return;
    }
    if !have("rustc") {
        eprintln!("skipped: needs rustc to build the guest's pattern tool");
        return;
    }
    let dir = std::env::temp_dir().join(format!("lanbus-vm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();

    // The pattern tool, static, for the guest; its checksum of the pattern on a local file.
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tool = dir.join("pattern");
    let out = Command::new("rustc")
        .args(["-O", "-C", "target-feature=+crt-static", "-o"])
        .arg(&tool)
        .arg(manifest.join("tests/vm/pattern.rs"))
        .output()
        .unwrap();
    assert!(out.status.success(), "rustc: {}", String::from_utf8_lossy(&out.stderr));
    let local = dir.join("local.img");
    std::fs::File::create(&local).unwrap().set_len(64 << 20).unwrap();
    let out = Command::new(&tool).args(["write", "1", "64"]).arg(&local).output().unwrap();
    assert!(out.status.success());
    let (want, _) = report(&String::from_utf8_lossy(&out.stdout));

    let socket = dir.join("vda.sock");
    let devices = [
        "-chardev".to_string(),
        format!("socket,id=c0,path={},reconnect=1", socket.display()),
        "-device".to_string(),
        "vhost-user-blk-pci,chardev=c0,num-queues=2".to_string(),
    ];
    let guest = Guest::build(&dir, WORKLOAD, &[(tool.clone(), "/bin/pattern")], devices.to_vec());

    let veth = VethPair::create().expect("namespaces");
    let nbd_socket = dir.join("nvme0.sock");
    let (dev_ctl, host_ctl) = (dir.join("dev.ctl"), dir.join("host.ctl"));
    let spawn = |ns: &lanbus_port::netns::Netns, args: Vec<String>, log: &str| {
        let log = std::fs::File::create(dir.join(log)).unwrap();
        Proc(ns.command(lanbus_path()).args(args).stdout(Stdio::null()).stderr(log).spawn().expect("daemon"))
    };
    let s = |x: &str| x.to_string();
    let _device = spawn(
        &veth.a.netns,
        vec![
            s("device"),
            s("--port"),
            format!("afpacket:{}", veth.a.ifname),
            s("--group"),
            s("5"),
            s("--nvme"),
            s("ram=128M"),
            s("--control"),
            dev_ctl.display().to_string(),
        ],
        "device.log",
    );
    let host_args = || {
        vec![
            s("host"),
            s("--port"),
            format!("afpacket:{}", veth.b.ifname),
            s("--group"),
            s("5"),
            s("--export"),
            format!("vhost-user-blk:{},queues=2", socket.display()),
            s("--export"),
            format!("nbd:{}", nbd_socket.display()),
            s("--control"),
            host_ctl.display().to_string(),
        ]
    };
    let mut host = spawn(&veth.b.netns, host_args(), "host.log");
    wait_for("the vhost-user-blk socket", Duration::from_secs(30), || socket.exists());

    // Write 64 MiB, power off; read them back in a new guest.
    let first = guest.boot("write,1,64", "write", LIMIT);
    assert!(first.contains("queues=2") && first.contains("sectors=262144"), "{first}");
    assert!(first.contains("lanbus-guest: exit 0"), "{first}");
    assert_eq!(report(&first), (want.clone(), 0), "the guest wrote the pattern");
    let second = guest.boot("read,1,64", "read", LIMIT);
    assert!(second.contains("lanbus-guest: exit 0"), "{second}");
    assert_eq!(report(&second), (want, 0), "the second guest read back what the first wrote");
    // The NBD export beside it serves the same driver: the guest's data is there too.
    let mut nbd = lanbus_nbd::Client::connect_unix(&nbd_socket, "nvme0").expect("the NBD export");
    let (mut theirs, ours) = (vec![0u8; 4 << 20], std::fs::read(&local).unwrap());
    nbd.read(60 << 20, &mut theirs).unwrap();
    assert!(theirs[..] == ours[60 << 20..], "NBD reads what the guest wrote");
    nbd.disconnect().unwrap();
    std::fs::remove_file(&local).unwrap();

    // A VMM killed while its guest writes: the backend takes the next VMM.
    let log = dir.join("killed.log");
    let mut q = guest.qemu("write,2,64", &log);
    let before = host_status(&host_ctl)["vhost_user_blk"]["written_bytes"].as_u64().unwrap();
    wait_for("the killed guest's writes", Duration::from_secs(90), || {
        host_status(&host_ctl)["vhost_user_blk"]["written_bytes"].as_u64().unwrap() > before + (4 << 20)
    });
    q.0.kill().unwrap();
    q.0.wait().unwrap();
    let third = guest.boot("rw,3,8", "after-kill", LIMIT);
    assert!(third.contains("lanbus-guest: exit 0"), "{third}");
    assert_eq!(report(&third).1, 0, "{third}");
    assert!(third.contains("zeroed=1 nonzero=0"), "{third}");

    let st = host_status(&host_ctl);
    let v = &st["vhost_user_blk"];
    assert!(v["connections"].as_u64().unwrap() >= 4, "{st}");
    // QEMU and the guest's driver took the event index, several queues, flush, discard and
    // write-zeroes.
    let acked =
        u64::from_str_radix(v["acked_features"].as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
    for bit in [29, 32, 12, 9, 13, 14] {
        assert_ne!(acked & (1 << bit), 0, "feature bit {bit} not acknowledged: {st}");
    }
    assert_eq!(v["io_errors"].as_u64().unwrap(), 0, "{st}");
    assert_eq!(v["protocol_errors"].as_u64().unwrap(), 0, "a VMM hanging up is not an error: {st}");
    assert!(v["read_bytes"].as_u64().unwrap() >= 72 << 20, "{st}");
    assert!(v["discards"].as_u64().unwrap() >= 1, "blkdiscard reached the backend as DISCARD: {st}");
    assert!(v["write_zeroes"].as_u64().unwrap() >= 1, "BLKZEROOUT reached it as WRITE_ZEROES: {st}");
    let mut host_log = String::new();
    std::fs::File::open(dir.join("host.log")).unwrap().read_to_string(&mut host_log).unwrap();
    assert!(host_log.contains("vhost-user-blk:"), "{host_log}");

    // The backend restarts under a running guest: QEMU's reconnect=1 takes the new one, and the
    // guest's reads after the restart are served by it.
    let log = dir.join("restart.log");
    let q = guest.qemu("pause,4,8", &log);
    wait_for("the guest's pause", Duration::from_secs(90), || {
        std::fs::read_to_string(&log).unwrap_or_default().contains("lanbus-guest: paused")
    });
    drop(host);
    assert!(!socket.exists(), "the stopped host removed its socket");
    host = spawn(&veth.b.netns, host_args(), "host-restarted.log");
    // Waits for a guest to power off and checks it read back what it wrote.
    let finishes_intact = |mut q: Proc, log: &Path, what: &str| {
        let t = Instant::now();
        while q.0.try_wait().unwrap().is_none() {
            assert!(
                t.elapsed() < LIMIT,
                "the guest did not finish {what}: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let text = std::fs::read_to_string(log).unwrap();
        eprintln!("guest {what}:\n{text}");
        assert!(text.contains("lanbus-guest: exit 0"), "{text}");
        assert_eq!(report(&text).1, 0, "{text}");
    };
    finishes_intact(q, &log, "after the restart");
    assert!(host_status(&host_ctl)["vhost_user_blk"]["read_bytes"].as_u64().unwrap() >= 8 << 20);

    // The backend killed in the middle of a guest's writes, and a new one started: nothing the
    // guest wrote is lost or written twice over something newer.
    let log = dir.join("busy.log");
    let q = guest.qemu("busy,6,64", &log);
    let before = host_status(&host_ctl)["vhost_user_blk"]["written_bytes"].as_u64().unwrap();
    wait_for("the busy guest's writes", Duration::from_secs(90), || {
        host_status(&host_ctl)["vhost_user_blk"]["written_bytes"].as_u64().unwrap() > before + (8 << 20)
    });
    host.0.kill().unwrap();
    host.0.wait().unwrap();
    host = spawn(&veth.b.netns, host_args(), "host-after-kill.log");
    finishes_intact(q, &log, "across a killed backend");

    // The I/O box goes: the host unexports, the socket goes with it, then the host stops cleanly.
    drop(_device);
    wait_for("the unexport", Duration::from_secs(30), || !socket.exists());
    drop(host);
    let _ = std::fs::remove_dir_all(&dir);
}
