//! `lanbus device` and `lanbus host` as processes over the `udp` port on loopback (no root):
//! enumeration and export, `lanbus status`, data written before a FLUSH surviving a restart of the
//! host daemon (same port, same MAC), unexport when the device goes away (clients get errors, not
//! hangs), clean SIGTERM shutdown with the data in the device's file.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lanbus_nbd::Client;

fn lanbus() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lanbus"))
}

struct Daemon(Child);

impl Daemon {
    fn term(&mut self) -> bool {
        let _ = Command::new("kill").args(["-TERM", &self.0.id().to_string()]).status();
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(s)) = self.0.try_wait() {
                return s.success();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[String], log: &Path) -> Daemon {
    let log = std::fs::File::create(log).unwrap();
    Daemon(lanbus().args(args).stdout(Stdio::null()).stderr(log).spawn().unwrap())
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(30), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn status(control: &Path) -> serde_json::Value {
    let out = lanbus().args(["status", "--json", "--control"]).arg(control).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2] ^ seed).collect()
}

#[test]
fn host_restart_keeps_flushed_data_and_device_loss_unexports() {
    let dir: PathBuf = std::env::temp_dir().join(format!("lanbus-daemons-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = 20_000 + (std::process::id() % 20_000) as u16;
    // host2 is the same port: the restarted host has the same address and MAC (the second run
    // takes its settings from the command line, the first from a TOML file).
    let (dev_port, host1, host2) = (base, base + 1, base + 1);
    let disk = dir.join("disk.img");
    let sock = dir.join("nvme0.sock");
    let (dev_ctl, host_ctl) = (dir.join("dev.ctl"), dir.join("host.ctl"));
    let s = |x: &str| x.to_string();
    let mut device = spawn(
        &[
            s("device"),
            s("--port"),
            format!("udp:127.0.0.1:{dev_port},peer=127.0.0.1:{host1}"),
            s("--group"),
            s("9"),
            s("--nvme"),
            format!("file={},size=32M", disk.display()),
            s("--control"),
            dev_ctl.display().to_string(),
            s("--metrics"),
            format!("127.0.0.1:{}", base + 2),
        ],
        &dir.join("device.log"),
    );
    let host_args = |port: u16, first: bool| {
        // The same keys from a TOML file for the first host, on the command line for the second.
        if first {
            let cfg = dir.join("host.toml");
            std::fs::write(
                &cfg,
                format!(
                    "port = \"udp:127.0.0.1:{port},peer=127.0.0.1:{dev_port}\"\ngroup = 9\nexport = \"nbd:{}\"\ncontrol = \"{}\"\n",
                    sock.display(),
                    host_ctl.display()
                ),
            )
            .unwrap();
            vec![s("host"), s("--config"), cfg.display().to_string()]
        } else {
            vec![
                s("host"),
                s("--port"),
                format!("udp:127.0.0.1:{port},peer=127.0.0.1:{dev_port}"),
                s("--group"),
                s("9"),
                s("--export"),
                format!("nbd:{}", sock.display()),
                s("--control"),
                host_ctl.display().to_string(),
            ]
        }
    };
    let mut host = spawn(&host_args(host1, true), &dir.join("host1.log"));
    wait_for("the export", || Client::connect_unix(&sock, "nvme0").is_ok());

    let st = status(&host_ctl);
    assert_eq!(st["role"], "host");
    assert!(st["export"].as_str().unwrap().contains("nvme0.sock"), "{st}");
    assert!(st["queues"]["io_queue_pairs"].as_u64().unwrap() >= 1, "{st}");
    assert!(st["devices"][0].as_str().unwrap().contains("1b36:0010"), "{st}");

    let mut c = Client::connect_unix(&sock, "nvme0").unwrap();
    assert_eq!(c.size_bytes(), 32 << 20);
    let a = pattern(1, 1 << 20);
    let b = pattern(2, 300 * 512);
    c.write(0, &a, false).unwrap();
    c.write(17 << 20, &b, false).unwrap();
    c.flush().unwrap();
    c.disconnect().unwrap();
    let st = status(&dev_ctl);
    assert_eq!(st["role"], "device");
    assert!(st["controller"]["io_commands"].as_u64().unwrap() >= 3, "{st}");
    // The metrics endpoint serves the same counters `lanbus status` shows, and they move.
    let scrape = || -> String {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", base + 2)).unwrap();
        conn.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
        let mut reply = String::new();
        conn.read_to_string(&mut reply).unwrap();
        assert!(reply.starts_with("HTTP/1.0 200 OK"), "{reply}");
        reply
    };
    let value = |text: &str, series: &str| -> f64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{series} ")))
            .unwrap_or_else(|| panic!("{series}: {text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let first = scrape();
    assert!(first.contains("# TYPE lanbus_frames_sent_total counter"), "{first}");
    assert_eq!(value(&first, "lanbus_group"), 9.0);
    let writes = value(&first, "lanbus_nvme_io_commands_total");
    // The bytes each part copied: the drive's data crossed the port, and the transport sent
    // at least what it lent.
    assert!(value(&first, "lanbus_port_tx_bytes_total") > 0.0, "{first}");
    let (sent, lent) =
        (value(&first, "lanbus_message_bytes_sent_total"), value(&first, "lanbus_message_bytes_lent_total"));
    assert!(sent > 0.0 && sent >= lent, "{first}");
    for series in ["lanbus_bridge_payload_bytes_copied_total", "lanbus_nvme_bytes_copied_total"] {
        value(&first, series);
    }
    assert!(st["metrics"]["lanbus_nvme_io_commands_total"].as_f64().unwrap() >= 3.0, "{st}");

    // The host restarts on the same port (same MAC, a new session): the data is there.
    assert!(host.term(), "host exits 0 on SIGTERM");
    assert!(!sock.exists(), "the export socket is removed at shutdown");
    let mut host = spawn(&host_args(host2, false), &dir.join("host2.log"));
    wait_for("the export after the restart", || Client::connect_unix(&sock, "nvme0").is_ok());
    let mut c = Client::connect_unix(&sock, "nvme0").unwrap();
    let mut back = vec![0u8; a.len()];
    c.read(0, &mut back).unwrap();
    assert!(back == a, "data written before FLUSH survives the host restart");
    let mut back = vec![0u8; b.len()];
    c.read(17 << 20, &mut back).unwrap();
    assert!(back == b);
    let later = scrape();
    assert!(value(&later, "lanbus_nvme_io_commands_total") > writes, "{later}");
    assert!(value(&later, "lanbus_frames_sent_total") > value(&first, "lanbus_frames_sent_total"));

    // The device goes away: the host unexports; the connected client gets an error, not a hang.
    assert!(device.term(), "device exits 0 on SIGTERM");
    let t = Instant::now();
    let mut buf = vec![0u8; 4096];
    let r = c.read(0, &mut buf);
    assert!(r.is_err() || t.elapsed() < Duration::from_secs(30));
    wait_for("the unexport", || !sock.exists());
    assert!(Client::connect_unix(&sock, "nvme0").is_err());
    assert!(host.term(), "host exits 0 on SIGTERM");
    let log = std::fs::read_to_string(dir.join("host2.log")).unwrap();
    assert!(log.contains("unexported"), "{log}");
    let file = std::fs::read(&disk).unwrap();
    assert!(file[..a.len()] == a[..] && file[17 << 20..(17 << 20) + b.len()] == b[..], "data in the file");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_group_set_at_run_time_survives_the_device_daemons_restart() {
    let dir: PathBuf = std::env::temp_dir().join(format!("lanbus-regroup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = 40_000 + (std::process::id() % 20_000) as u16;
    let ctl = dir.join("dev.ctl");
    let run = |group: u16, log: &str| {
        let args = [
            "device".to_string(),
            "--port".into(),
            format!("udp:127.0.0.1:{base},peer=127.0.0.1:{}", base + 1),
            "--group".into(),
            group.to_string(),
            "--dma-engine".into(),
            "--control".into(),
            ctl.display().to_string(),
        ];
        let d = spawn(&args, &dir.join(log));
        wait_for("the control socket", || ctl.exists());
        d
    };
    let group_now = || status(&ctl)["group"].as_u64().unwrap();
    let mut d = run(9, "run1.log");
    assert_eq!(group_now(), 9);
    let out = lanbus().arg("device-ctl").arg(&ctl).args(["group", "11"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(group_now(), 11);
    assert!(d.term());
    // Restarted with the same configuration: still group 11, and it says why.
    let mut d = run(9, "run2.log");
    assert_eq!(group_now(), 11);
    assert!(d.term());
    let log = std::fs::read_to_string(dir.join("run2.log")).unwrap();
    assert!(log.contains("serving group 11, set at run time"), "{log}");
    // A new configured group wins over the old run time choice.
    let mut d = run(12, "run3.log");
    assert_eq!(group_now(), 12);
    assert!(d.term());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_arguments_fail_with_a_message() {
    let out = lanbus().args(["device", "--port", "udp:127.0.0.1:1", "--nvme", "disk=/x"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("file=PATH"));
    let out = lanbus().args(["host", "--port", "udp:127.0.0.1:1", "--export", "tcp:1"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nbd:PATH"));
    let out = lanbus().args(["status", "--control", "/nonexistent/lanbus.sock"]).output().unwrap();
    assert!(!out.status.success());
}
