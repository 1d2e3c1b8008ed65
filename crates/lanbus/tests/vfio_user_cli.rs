//! `lanbus host --export vfio-user:PATH` as a process over the `udp` port on loopback (no root):
//! the NVMe function of a `lanbus device` reaches an independent vfio-user client (rust-vmm's
//! `vfio_user` crate) with its configuration space and registers, `lanbus status` counts the
//! client, the socket goes when the device goes, and combining the export with one that runs the
//! host's own driver is refused.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{lanbus_path, Daemon};

fn lanbus() -> Command {
    Command::new(lanbus_path())
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

#[test]
fn the_nvme_function_reaches_a_vfio_user_client_and_leaves_with_its_device() {
    let dir = std::env::temp_dir().join(format!("lanbus-vfio-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = 40_000 + (std::process::id() % 10_000) as u16;
    let (dev_port, host_port) = (base, base + 1);
    let sock = dir.join("nvme.sock");
    let host_ctl = dir.join("host.ctl");
    let s = |x: &str| x.to_string();
    let mut device = spawn(
        &[
            s("device"),
            s("--port"),
            format!("udp:127.0.0.1:{dev_port},peer=127.0.0.1:{host_port}"),
            s("--group"),
            s("4"),
            s("--nvme"),
            s("ram=16M"),
            s("--control"),
            dir.join("dev.ctl").display().to_string(),
        ],
        &dir.join("device.log"),
    );
    let host_args = |export: &[&str]| {
        let mut a = vec![
            s("host"),
            s("--port"),
            format!("udp:127.0.0.1:{host_port},peer=127.0.0.1:{dev_port}"),
            s("--group"),
            s("4"),
            s("--control"),
            host_ctl.display().to_string(),
        ];
        for e in export {
            a.extend([s("--export"), e.to_string()]);
        }
        a
    };
    let both = lanbus().args(host_args(&["vfio-user:/tmp/x.sock", "nbd:/tmp/y.sock"])).output().unwrap();
    assert!(!both.status.success());
    assert!(String::from_utf8_lossy(&both.stderr).contains("cannot be combined"), "{both:?}");

    let _host = spawn(&host_args(&[&format!("vfio-user:{}", sock.display())]), &dir.join("host.log"));
    wait_for("the vfio-user socket", || sock.exists());
    let mut c = vfio_user::Client::new(&sock).expect("an independent client negotiates with the server");
    let mut id = [0u8; 4];
    c.region_read(7, 0, &mut id).unwrap();
    assert_eq!(&id, &[0x36, 0x1b, 0x10, 0x00], "QEMU's NVMe IDs, as the controller reports them");
    assert!(c.region(0).unwrap().size >= 0x4000, "BAR0 holds the registers and doorbells");
    let mut vs = [0u8; 4];
    c.region_read(0, 0x08, &mut vs).unwrap();
    assert!(u32::from_le_bytes(vs) >= 0x0001_0400, "NVMe version register, read across the fabric");

    let out = lanbus().args(["status", "--json", "--control"]).arg(&host_ctl).output().unwrap();
    let st: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st["vfio_user"]["connections"], 1, "{st}");
    assert!(st["export"].as_str().unwrap().starts_with("vfio-user:"), "{st}");
    assert!(st["vfio_user"]["region_accesses"].as_u64().unwrap() >= 2, "{st}");
    c.shutdown().unwrap();

    let _ = device.0.kill();
    let _ = device.0.wait();
    wait_for("the socket to go with the device", || !sock.exists());
    let _ = std::fs::remove_dir_all(&dir);
}
