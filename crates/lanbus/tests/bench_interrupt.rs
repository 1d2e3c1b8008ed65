//! An interrupted bench leaves nothing behind: SIGINT (Ctrl-C) in the middle of `bench nvme`
//! removes its scratch directory (a backing file in /dev/shm) and ends its qemu-nbd; in the
//! middle of `bench transport` (root) it removes the bench's network namespaces.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn have(program: &str, arg: &str) -> bool {
    Command::new(program).arg(arg).output().is_ok_and(|o| o.status.success())
}

/// Polls `cond` every 20 ms for up to `secs`.
fn wait_for(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}

/// Processes whose command line mentions `needle` (other than the test's own `pgrep`).
fn processes_mentioning(needle: &str) -> String {
    let out = Command::new("pgrep").args(["-af", needle]).output().expect("pgrep (procps)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Sends SIGINT and returns the signal that ended the bench (after its cleanup it re-raises it,
/// so that a shell loop running benches stops too).
fn interrupt(child: &mut Child) -> Option<i32> {
    let ok = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success();
    assert!(ok, "kill -INT");
    std::os::unix::process::ExitStatusExt::signal(&child.wait().unwrap())
}

#[test]
fn an_interrupted_nvme_bench_removes_its_scratch_files_and_ends_qemu_nbd() {
    if !have("fio", "--version") {
        eprintln!("skipped: needs fio (Debian package fio; .ci/run installs it)");
        return;
    }
    let with_qemu = have("qemu-nbd", "--version");
    let rows = if with_qemu { "peer:qemu-nbd" } else { "local" };
    let mut child = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args([
            "bench",
            "nvme",
            "--quick",
            "--only",
            rows,
            "--block-sizes",
            "4k,8k,16k,32k",
            "--size-mib",
            "16",
        ])
        .args(["--png", "/dev/null/never-written"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let dir = PathBuf::from(format!("/dev/shm/lanbus-bench-nvme-{}", child.id()));
    let dir = if PathBuf::from("/dev/shm").is_dir() {
        dir
    } else {
        std::env::temp_dir().join(dir.file_name().unwrap())
    };
    let socket = dir.join("qemu-nbd.sock").display().to_string();
    // Interrupt it in the middle: once fio runs against the row (its URI names the directory).
    let needle = dir.display().to_string();
    assert!(wait_for(60, || processes_mentioning(&needle).contains("fio --name")), "fio never started");
    if with_qemu {
        assert!(processes_mentioning(&socket).contains("qemu-nbd"), "qemu-nbd serves the row");
    }
    assert!(dir.is_dir());
    assert_eq!(interrupt(&mut child), Some(2), "ended by SIGINT");
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("interrupted"), "says what it did: {stderr}");
    assert!(!dir.exists(), "{} removed", dir.display());
    assert!(wait_for(5, || processes_mentioning(&needle).is_empty()), "qemu-nbd and fio ended");
}

#[test]
fn an_interrupted_transport_bench_removes_its_namespaces() {
    // Namespaces need root.
    let uid = Command::new("id").arg("-u").output().unwrap();
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        eprintln!("skipped: needs root (network namespaces); run as root, as CI does");
        return;
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args(["bench", "transport", "--quick", "--ports", "udp"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let prefix = format!("lanbus-{:x}x", child.id());
    let ours = || {
        let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with(&prefix)).count()
    };
    assert!(wait_for(30, || ours() == 2), "the bench made its two namespaces");
    // Let it start a peer in them.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(interrupt(&mut child), Some(2), "ended by SIGINT");
    assert_eq!(ours(), 0, "namespaces {prefix}* removed");
}
