//! `lanbus device`, `lanbus lspci` and `lanbus device-ctl` as a user runs them, over udp on the
//! loopback interface (no root needed).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn lanbus(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lanbus")).args(args).output().expect("run lanbus");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn lspci_lists_the_dma_engine_and_group_changes_move_it() {
    let (pd, ph) = (free_port(), free_port());
    let dev_spec = format!("udp:127.0.0.1:{pd},peer=127.0.0.1:{ph}");
    let host_spec = format!("udp:127.0.0.1:{ph},peer=127.0.0.1:{pd}");
    let ctl = std::env::temp_dir().join(format!("lanbus-test-ctl-{}.sock", std::process::id()));
    let ctl_s = ctl.to_str().unwrap().to_string();
    let mut device = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args(["device", "--port", &dev_spec, "--group", "7", "--dma-engine", "--control", &ctl_s])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !ctl.exists() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }

    let (ok, out, err) = lanbus(&["lspci", "--port", &host_spec, "--group", "7", "--wait", "3"]);
    assert!(ok, "{err}");
    assert!(out.contains("01:00.0 System peripheral [0880]: Device 4c42:0001"), "{out}");
    assert!(out.contains("Memory at e0000000 (32-bit, non-prefetchable) [size=4K] (BAR0)"), "{out}");
    assert!(out.contains("MSI-X: Enable+ Count=4"), "{out}");
    assert!(out.contains("group 7"), "{out}");

    let (ok, out, _) = lanbus(&["device-ctl", &ctl_s, "status"]);
    assert!(ok && out.contains("group 7"), "{out}");
    let (ok, out, _) = lanbus(&["device-ctl", &ctl_s, "group", "8"]);
    assert!(ok && out.contains("ok group 8"), "{out}");
    let (ok, out, err) = lanbus(&["lspci", "--port", &host_spec, "--group", "7", "--wait", "1"]);
    assert!(ok && !out.contains("4c42:0001"), "{out}{err}");
    let (ok, out, err) = lanbus(&["lspci", "--port", &host_spec, "--group", "8", "--wait", "3"]);
    assert!(ok && out.contains("4c42:0001") && out.contains("group 8"), "{out}{err}");
    let (ok, _, _) = lanbus(&["device-ctl", &ctl_s, "frobnicate"]);
    assert!(!ok);

    // SIGTERM stops the daemon cleanly and removes its socket.
    Command::new("kill").args(["-TERM", &device.id().to_string()]).status().unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = device.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "the device did not stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success());
    assert!(!ctl.exists());
}
