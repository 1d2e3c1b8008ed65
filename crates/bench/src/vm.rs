//! `lanbus bench vm`: a Linux guest under QEMU on the remote devices, against the same guest on
//! the local alternatives a VM would otherwise use.
//!
//! The guest (Debian's kernel and a busybox initramfs from `scripts/guest`) times its own I/O
//! with `/proc/uptime` and reports on its console:
//! - block rows: `dd` of `--mib` MiB with 1 MiB blocks and O_DIRECT, written then read, on its
//!   virtio-blk disk (`write_mb_per_s`, `read_mb_per_s`). `blk:lanbus` is the remote NVMe drive
//!   through `lanbus host --export vhost-user-blk` (the I/O box on a RAM drive, the fabric a
//!   veth crossed by `--port`); the peer `blk:qsd` is qemu-storage-daemon's own vhost-user-blk
//!   export of a file in /dev/shm; `blk:nbd-tcp` is QEMU's NBD client reaching qemu-nbd (a file in
//!   /dev/shm) across a veth, the socket path a VM would use without lanbus.
//! - network rows: busybox `wget` fetching a `--mib` MiB file from python's http.server and
//!   posting it back (`fetch_mb_per_s`, `post_mb_per_s`). `net:lanbus` goes through the remote
//!   NIC (`--export vhost-user-net`, the I/O box's TAP bridged to the server); the peer
//!   `net:tap` is QEMU's own virtio-net on a TAP bridged to a veth toward the same server.
//! - the fabric's own cost in the same run: fio (nbd engine, 1 MiB sequential, depth 1) against
//!   the same host's NBD export of the drive (`fabric:lanbus-nbd`) and against qemu-nbd on a local
//!   file (`fabric:qemu-nbd`), as `bench nvme` measures it.
//!
//! Under TCG the guest's CPU bounds everything it does, so these figures are a comparison, not a
//! speed: each lanbus row carries its ratio to its peer, and the table's notes set the block
//! rows' ratio beside the fabric's. Rows run in turns (`--runs`, default 3), each a fresh boot; a
//! figure is the median. Needs root (namespaces, TAP), QEMU, qemu-storage-daemon, qemu-nbd, fio,
//! python3 and busybox-static.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use lanbus_port::netns::{Netns, VethPair};

use super::interrupt::KillOnDrop;
use super::nbd::run_fio;
use super::report::{median, Report, Row};

/// `lanbus bench vm` options.
#[derive(Debug, Args)]
pub struct VmBenchArgs {
    /// Write the common JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Runs of every row, in turns (each a fresh guest); a figure is their median.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// MiB each transfer moves.
    #[arg(long, default_value_t = 64)]
    mib: u64,
    /// The fabric's port kind between host and I/O box (udp, afpacket, afxdp).
    #[arg(long, default_value = "afpacket")]
    port: String,
    /// The script that builds the guest (the repository's scripts/guest).
    #[arg(long, default_value = "scripts/guest")]
    guest_script: PathBuf,
    /// QEMU accelerators to try, comma separated (`kvm,tcg` where KVM works).
    #[arg(long, default_value = "tcg")]
    accel: String,
}

const GUEST_MIB: u64 = 384;
const MAC: &str = "02:00:00:79:00:01";
/// The server behind the remote NIC and the guest there; the server on the direct path and the
/// guest there.
const NIC_SERVER: &str = "10.79.0.2";
const NIC_GUEST: &str = "10.79.0.5";
const TAP_SERVER: &str = "10.80.0.2";
const TAP_GUEST: &str = "10.80.0.5";
const NBD_PORT: u16 = 10809;

const WORKLOAD: &str = r#"#!/bin/sh
# lanbus.cmd=blk,MIB or net,MIB,GUEST_IP,SERVER_IP; prints `result NAME=MB/s` lines.
up() { cut -d' ' -f1 /proc/uptime; }
rate() { awk -v b="$1" -v a="$2" -v c="$3" 'BEGIN { d = c - a; if (d < 0.01) d = 0.01; printf "%.1f", b / d / 1e6 }'; }
mib=$2
case $1 in
blk)
  i=0
  while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
  [ -b /dev/vda ] || { echo "no /dev/vda"; exit 3; }
  t0=$(up); dd if=/dev/zero of=/dev/vda bs=1M count="$mib" oflag=direct 2>/dev/null || exit 4; t1=$(up)
  echo "result write_mb_per_s=$(rate $((mib << 20)) "$t0" "$t1")"
  echo 3 >/proc/sys/vm/drop_caches
  t0=$(up); dd if=/dev/vda of=/dev/null bs=1M count="$mib" iflag=direct 2>/dev/null || exit 5; t1=$(up)
  echo "result read_mb_per_s=$(rate $((mib << 20)) "$t0" "$t1")"
  ;;
net)
  ip=$3 server=$4
  i=0
  while ! ip link show eth0 >/dev/null 2>&1 && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
  ip link set eth0 up && ip addr add "$ip/24" dev eth0 || exit 3
  i=0
  until ping -c 1 -W 1 "$server" >/dev/null 2>&1; do i=$((i + 1)); [ $i -lt 30 ] || exit 4; done
  t0=$(up); wget -q -O /tmp/f "http://$server:8000/file" || exit 5; t1=$(up)
  echo "result fetch_mb_per_s=$(rate $((mib << 20)) "$t0" "$t1")"
  t0=$(up); wget -q -O /dev/null --post-file /tmp/f "http://$server:8001/" || exit 6; t1=$(up)
  echo "result post_mb_per_s=$(rate $((mib << 20)) "$t0" "$t1")"
  ;;
esac
"#;

/// Takes a POST and answers its length.
const SINK: &str = r#"
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        left = int(self.headers["Content-Length"])
        total = 0
        while left:
            b = self.rfile.read(min(left, 1 << 20))
            if not b:
                break
            total += len(b)
            left -= len(b)
        body = str(total).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("0.0.0.0", 8001), H).serve_forever()
"#;

fn ok(out: std::io::Result<std::process::Output>, what: &str) -> anyhow::Result<String> {
    let out = out.with_context(|| what.to_string())?;
    if !out.status.success() {
        bail!("{what}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn have(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> anyhow::Result<()> {
    let t = Instant::now();
    while !f() {
        if t.elapsed() > limit {
            bail!("timed out waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Everything the rows share: namespaces, daemons, servers, the built guest.
struct Lab {
    dir: PathBuf,
    veth: VethPair,
    server: Netns,
    accel: String,
    _daemons: Vec<KillOnDrop>,
}

impl Lab {
    fn build(args: &VmBenchArgs, dir: &Path) -> anyhow::Result<Lab> {
        let veth = VethPair::create().map_err(|s| anyhow::anyhow!("bench vm needs root: {s}"))?;
        let server = Netns::create(&format!("lanbus-vm-srv-{}", std::process::id()))?;
        let (host, io) = (&veth.a.netns, &veth.b.netns);
        let link = |a: &Netns, an: &str, b: &Netns, bn: &str| {
            ok(
                Command::new("ip")
                    .args(["link", "add", an, "netns", a.name(), "type", "veth", "peer", "name", bn])
                    .args(["netns", b.name()])
                    .output(),
                "a veth",
            )
        };
        // The I/O box's wire: its TAP and a veth to the server in one bridge. The direct path:
        // the host's TAP for QEMU's own virtio-net and a veth to the server in another.
        for (ns, bridge, port, peer, addr) in
            [(io, "br0", "wire", "eth0", NIC_SERVER), (host, "vmbr", "direct", "direct", TAP_SERVER)]
        {
            ok(ns.ip(&["link", "add", bridge, "type", "bridge"]), "a bridge")?;
            link(ns, port, &server, peer)?;
            ok(ns.ip(&["link", "set", port, "master", bridge, "up"]), "a bridge port")?;
            ok(ns.ip(&["link", "set", bridge, "up"]), "a bridge up")?;
            ok(server.ip(&["addr", "add", &format!("{addr}/24"), "dev", peer]), "the server's address")?;
            ok(server.ip(&["link", "set", peer, "up"]), "the server's link")?;
        }
        ok(server.ip(&["link", "set", "lo", "up"]), "the server's loopback")?;

        let mut daemons = Vec::new();
        let exe = std::env::current_exe().context("finding this program")?;
        let (host_spec, io_spec) = crate::port_specs(&args.port, &veth)?;
        let log = |n: &str| std::fs::File::create(dir.join(n));
        let spawn = |c: &mut Command, log: std::fs::File| -> anyhow::Result<KillOnDrop> {
            Ok(KillOnDrop(c.stdout(Stdio::null()).stderr(log).spawn()?))
        };
        daemons.push(spawn(
            io.command(&exe.to_string_lossy())
                .args(["device", "--port", &io_spec, "--group", "7"])
                .args(["--nvme", &format!("ram={}M", args.mib * 2 + 16)])
                .args(["--nic", &format!("tap=nic0,mac={MAC}"), "--control"])
                .arg(dir.join("io.ctl")),
            log("io.log")?,
        )?);
        wait_for("the I/O box's TAP", Duration::from_secs(30), || {
            io.ip(&["link", "show", "nic0"]).is_ok_and(|o| o.status.success())
        })?;
        ok(io.ip(&["link", "set", "nic0", "master", "br0", "up"]), "the TAP into the box's bridge")?;
        let s = |p: &str| dir.join(p).display().to_string();
        daemons.push(spawn(
            host.command(&exe.to_string_lossy())
                .args(["host", "--port", &host_spec, "--group", "7"])
                .args(["--export", &format!("vhost-user-blk:{}", s("vda.sock"))])
                .args(["--export", &format!("nbd:{}", s("nvme0.sock"))])
                .args(["--export", &format!("vhost-user-net:{}", s("net0.sock"))])
                .args(["--control", &s("host.ctl")]),
            log("host.log")?,
        )?);
        for sock in ["vda.sock", "nvme0.sock", "net0.sock"] {
            wait_for(&format!("the host's {sock}"), Duration::from_secs(30), || dir.join(sock).exists())?;
        }

        // The peers' backing: files in /dev/shm (RAM, as the I/O box's drive).
        let shm = PathBuf::from(format!("/dev/shm/lanbus-bench-vm-{}", std::process::id()));
        std::fs::create_dir_all(&shm)?;
        let backing = |name: &str| -> anyhow::Result<PathBuf> {
            let p = shm.join(name);
            std::fs::File::create(&p)?.set_len((args.mib * 2 + 16) << 20)?;
            Ok(p)
        };
        let qsd_file = backing("qsd.img")?;
        daemons.push(spawn(
            Command::new("qemu-storage-daemon")
                .arg("--blockdev")
                .arg(format!("driver=file,node-name=disk,filename={},cache.direct=off", qsd_file.display()))
                .arg("--export")
                .arg(format!(
                    "type=vhost-user-blk,id=vda,node-name=disk,addr.type=unix,addr.path={},writable=on",
                    s("qsd.sock")
                )),
            log("qsd.log")?,
        )?);
        let nbd_file = backing("nbd.img")?;
        daemons.push(spawn(
            io.command("qemu-nbd")
                .args(["--persistent", "--shared=4", "--format=raw", "--cache=writeback"])
                .args(["--bind", &veth.b.ipv4.to_string(), "--port", &NBD_PORT.to_string()])
                .arg(&nbd_file),
            log("qemu-nbd-tcp.log")?,
        )?);
        let local_file = backing("local.img")?;
        daemons.push(spawn(
            Command::new("qemu-nbd")
                .args(["--persistent", "--shared=4", "--format=raw", "--cache=writeback", "--socket"])
                .arg(dir.join("qemu-nbd.sock"))
                .arg(&local_file),
            log("qemu-nbd.log")?,
        )?);
        for sock in ["qsd.sock", "qemu-nbd.sock"] {
            wait_for(sock, Duration::from_secs(30), || dir.join(sock).exists())?;
        }

        // The servers: the file to fetch (no zero byte: busybox's wget posts with strlen) and a
        // sink for posts.
        let www = dir.join("www");
        std::fs::create_dir_all(&www)?;
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let data: Vec<u8> = (0..args.mib << 20)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 24) % 255) as u8 + 1
            })
            .collect();
        std::fs::write(www.join("file"), data)?;
        daemons.push(spawn(
            server.command("python3").args(["-m", "http.server", "8000", "--directory"]).arg(&www),
            log("http.log")?,
        )?);
        daemons.push(spawn(server.command("python3").args(["-c", SINK]), log("sink.log")?)?);
        std::thread::sleep(Duration::from_millis(500));
        Ok(Lab { dir: dir.to_path_buf(), veth, server, accel: args.accel.clone(), _daemons: daemons })
    }

    /// Boots the guest with `devices` (QEMU run in `ns`, or here) running `cmd`; its `result`
    /// lines.
    fn boot(
        &self,
        ns: Option<&Netns>,
        devices: &[String],
        cmd: &str,
        name: &str,
    ) -> anyhow::Result<BTreeMap<String, f64>> {
        let log = self.dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log)?;
        let mut c = match ns {
            Some(ns) => ns.command("qemu-system-x86_64"),
            None => Command::new("qemu-system-x86_64"),
        };
        c.args(["-machine", "q35", "-smp", "2", "-nographic", "-no-reboot", "-nic", "none"])
            .args(["-m", &format!("{GUEST_MIB}M")]);
        for a in self.accel.split(',') {
            c.args(["-accel", a]);
        }
        c.args(["-object", &format!("memory-backend-memfd,id=mem,size={GUEST_MIB}M,share=on")])
            .args(["-numa", "node,memdev=mem"])
            .args(devices)
            .arg("-kernel")
            .arg(self.dir.join("guest/vmlinuz"))
            .arg("-initrd")
            .arg(self.dir.join("guest/initramfs.cpio.gz"))
            .args(["-append", &format!("console=ttyS0 panic=-1 quiet lanbus.cmd={cmd}")]);
        let mut q = KillOnDrop(c.stdin(Stdio::null()).stdout(out.try_clone()?).stderr(out).spawn()?);
        let t = Instant::now();
        while q.0.try_wait()?.is_none() {
            if t.elapsed() > Duration::from_secs(300) {
                bail!("the guest ({name}) did not finish in 300 s (see {})", log.display());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let text = std::fs::read_to_string(&log)?;
        if !text.contains("lanbus-guest: exit 0") {
            bail!(
                "the guest ({name}) failed: {}",
                text.lines().rev().take(8).collect::<Vec<_>>().join(" | ")
            );
        }
        Ok(text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("result "))
            .filter_map(|r| r.split_once('='))
            .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
            .collect())
    }

    /// QEMU's arguments for a vhost-user device on `socket`.
    fn vhost(&self, socket: &str, net: bool) -> Vec<String> {
        let chardev = format!("socket,id=c0,path={},reconnect=1", self.dir.join(socket).display());
        let mut d = vec!["-chardev".to_string(), chardev];
        if net {
            d.extend(["-netdev", "vhost-user,id=n0,chardev=c0", "-device"].map(String::from));
            // vectors=0: QEMU 7.2's vhost-user-net crashes setting up MSI-X notifiers under TCG.
            d.push(format!("virtio-net-pci,netdev=n0,mac={MAC},vectors=0"));
        } else {
            d.extend(["-device", "vhost-user-blk-pci,chardev=c0,num-queues=1"].map(String::from));
        }
        d
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let _ = &self.server;
    }
}

/// One row: its name, QEMU's namespace (None: here), devices, and the workload's command.
struct RowSpec {
    name: &'static str,
    in_host_ns: bool,
    devices: Vec<String>,
    cmd: String,
}

/// Runs `lanbus bench vm`.
pub fn run(args: VmBenchArgs) -> anyhow::Result<()> {
    if args.runs == 0 || args.mib == 0 || args.mib > 128 {
        bail!("--runs must be at least 1 and --mib from 1 to 128 (the guest holds the file in RAM)");
    }
    if !["udp", "afpacket", "afxdp"].contains(&args.port.as_str()) {
        bail!("--port: {:?} is not udp, afpacket or afxdp", args.port);
    }
    for (program, package) in [
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("qemu-storage-daemon", "qemu-system-common"),
        ("qemu-nbd", "qemu-utils"),
        ("fio", "fio"),
        ("python3", "python3"),
    ] {
        if !have(program) {
            bail!("bench vm needs {program} (Debian package {package}; scripts/setup installs it)");
        }
    }
    if !args.guest_script.exists() {
        bail!(
            "no guest builder at {} (run from the repository or give --guest-script PATH to scripts/guest)",
            args.guest_script.display()
        );
    }
    let dir = std::env::temp_dir().join(format!("lanbus-bench-vm-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = measure(&args, &dir);
    let _ = std::fs::remove_dir_all(format!("/dev/shm/lanbus-bench-vm-{}", std::process::id()));
    let report = result.with_context(|| format!("the logs are in {}", dir.display()))?;
    let _ = std::fs::remove_dir_all(&dir);
    report.finish(args.json.as_deref())?;
    Ok(())
}

fn measure(args: &VmBenchArgs, dir: &Path) -> anyhow::Result<Report> {
    eprintln!("bench vm: building the guest");
    std::fs::write(dir.join("workload.sh"), WORKLOAD)?;
    ok(
        Command::new(&args.guest_script)
            .arg("build")
            .arg(dir.join("guest"))
            .arg("--workload")
            .arg(dir.join("workload.sh"))
            .output(),
        "scripts/guest",
    )?;
    eprintln!("bench vm: starting the host, the I/O box and the peers");
    let lab = Lab::build(args, dir)?;
    let mib = args.mib;
    let tap_devices = ["-netdev", "tap,id=t0,ifname=vmtap0,script=no,downscript=no,vhost=off", "-device"]
        .map(String::from)
        .into_iter()
        .chain([format!("virtio-net-pci,netdev=t0,mac={MAC}")])
        .collect();
    let nbd_drive = format!(
        "driver=raw,file.driver=nbd,file.server.type=inet,file.server.host={},file.server.port={NBD_PORT},if=virtio,cache=none",
        lab.veth.b.ipv4
    );
    let rows = [
        RowSpec {
            name: "blk:lanbus",
            in_host_ns: false,
            devices: lab.vhost("vda.sock", false),
            cmd: format!("blk,{mib}"),
        },
        RowSpec {
            name: "blk:qsd",
            in_host_ns: false,
            devices: lab.vhost("qsd.sock", false),
            cmd: format!("blk,{mib}"),
        },
        RowSpec {
            name: "blk:nbd-tcp",
            in_host_ns: true,
            devices: vec!["-drive".into(), nbd_drive],
            cmd: format!("blk,{mib}"),
        },
        RowSpec {
            name: "net:lanbus",
            in_host_ns: false,
            devices: lab.vhost("net0.sock", true),
            cmd: format!("net,{mib},{NIC_GUEST},{NIC_SERVER}"),
        },
        RowSpec {
            name: "net:tap",
            in_host_ns: true,
            devices: tap_devices,
            cmd: format!("net,{mib},{TAP_GUEST},{TAP_SERVER}"),
        },
    ];
    let mut samples: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    let host = &lab.veth.a.netns;
    let total = args.runs * (rows.len() + 1);
    let mut step = 0;
    for run in 0..args.runs {
        for row in &rows {
            step += 1;
            eprintln!("bench vm: {step}/{total} run {} {}", run + 1, row.name);
            if row.name == "net:tap" {
                // QEMU makes the TAP; it joins the bridge once it exists.
                let h = host.name().to_string();
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let joined = Command::new("ip")
                            .args(["-n", &h, "link", "set", "vmtap0", "master", "vmbr", "up"])
                            .stderr(Stdio::null())
                            .status();
                        if joined.is_ok_and(|s| s.success()) {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                });
            }
            let ns = row.in_host_ns.then_some(host);
            match lab.boot(ns, &row.devices, &row.cmd, &format!("{}-{run}", row.name.replace(':', "-"))) {
                Ok(results) => {
                    for (k, v) in results {
                        samples.entry((row.name.to_string(), k)).or_default().push(v);
                    }
                }
                Err(e) => eprintln!("bench vm: {}: {e:#}", row.name),
            }
        }
        step += 1;
        eprintln!("bench vm: {step}/{total} run {} fabric (fio)", run + 1);
        let uris = [
            ("fabric:lanbus-nbd", format!("nbd+unix:///nvme0?socket={}", dir.join("nvme0.sock").display())),
            ("fabric:qemu-nbd", format!("nbd+unix:///?socket={}", dir.join("qemu-nbd.sock").display())),
        ];
        for (name, uri) in &uris {
            for (rw, metric) in [("write", "write_mb_per_s"), ("read", "read_mb_per_s")] {
                match run_fio(None, uri, rw, "1m", 1, 1, mib, 2) {
                    Ok(r) => {
                        samples.entry((name.to_string(), metric.to_string())).or_default().push(r.mb_per_s)
                    }
                    Err(e) => eprintln!("bench vm: {name} {rw}: {e:#}"),
                }
            }
        }
    }
    let med =
        |row: &str, metric: &str| samples.get(&(row.to_string(), metric.to_string())).and_then(|v| median(v));
    let mut report = Report::new("vm");
    for ((row, metric), v) in &samples {
        let mut r = Row::new(row.as_str(), metric.as_str(), median(v).unwrap_or(0.0))
            .with("runs", v.len())
            .with("mib", mib)
            .with("accel", args.accel.as_str());
        let peer = match row.as_str() {
            "blk:lanbus" | "blk:nbd-tcp" => Some("blk:qsd"),
            "net:lanbus" => Some("net:tap"),
            "fabric:lanbus-nbd" => Some("fabric:qemu-nbd"),
            _ => None,
        };
        if let (Some(p), Some(x)) = (peer, median(v)) {
            if let Some(y) = med(p, metric) {
                r = r.with(&format!("ratio_vs_{}", p.split(':').nth(1).unwrap_or(p)), x / y.max(1e-9));
            }
        }
        if row.ends_with(":lanbus") {
            r = r.with("port", args.port.as_str());
        }
        report.push(r);
    }
    for metric in ["read_mb_per_s", "write_mb_per_s"] {
        if let (Some(a), Some(b), Some(c), Some(d)) = (
            med("blk:lanbus", metric),
            med("blk:qsd", metric),
            med("fabric:lanbus-nbd", metric),
            med("fabric:qemu-nbd", metric),
        ) {
            eprintln!(
                "bench vm: {metric}: the guest on the remote drive at {:.2}x of qemu-storage-daemon's local file; \
                 the fabric alone (fio over NBD) at {:.2}x of qemu-nbd's",
                a / b.max(1e-9),
                c / d.max(1e-9)
            );
        }
    }
    Ok(report)
}
