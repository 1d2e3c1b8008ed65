//! `lanbus port check SPEC` as a user runs it.

use std::process::Command;

fn lanbus(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lanbus")).args(args).output().expect("run lanbus");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn a_working_spec_prints_mac_mtu_and_counters() {
    let (ok, stdout, stderr) = lanbus(&["port", "check", "udp:127.0.0.1:0,mtu=9000", "--listen", "0.05"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("mac       02:4c:55:"), "{stdout}");
    assert!(stdout.contains("mtu       9000 bytes"), "{stdout}");
    assert!(stdout.contains("rx        0 frames"), "{stdout}");
}

#[test]
fn a_broken_spec_says_why() {
    let (ok, _, stderr) = lanbus(&["port", "check", "afpacket:lbnosuchif7"]);
    assert!(!ok);
    assert!(stderr.contains("no interface named \"lbnosuchif7\""), "{stderr}");
    let (ok, _, stderr) = lanbus(&["port", "check", "udp:127.0.0.1:7000,peer=nowhere"]);
    assert!(!ok);
    assert!(stderr.contains("bad port spec") && stderr.contains("not IP:PORT"), "{stderr}");
}

#[test]
fn help_documents_every_spec() {
    let (ok, stdout, _) = lanbus(&["--help"]);
    assert!(ok);
    for kind in ["sim", "udp:BIND_IP:PORT", "afpacket:IFACE", "afxdp:IFACE", "shm:PATH", "dpdk:EAL_ARGS"] {
        assert!(stdout.contains(kind), "{kind} missing from --help");
    }
}
