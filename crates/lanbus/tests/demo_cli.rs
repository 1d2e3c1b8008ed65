//! `lanbus demo` through the binary: no arguments, exits 0 with every byte verified, and shows
//! enumeration, the export, the bandwidth table and the transport's retransmissions.

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn demo_runs_the_remote_drive_and_verifies_everything() {
    let t = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_lanbus")).arg("demo").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for needle in [
        "1b36:0010",
        "Mass storage controller [0108]",
        "MSI-X: Enable+ Count=17",
        "exported over NBD: nbd+unix:///nvme0?socket=",
        "whole drive read back and compared: identical",
        "write MB/s",
        "retransmitted",
        "all data verified",
        "threads: all on CPU",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
    assert!(t.elapsed() < Duration::from_secs(60), "the demo took {:?}", t.elapsed());
}

#[test]
fn demo_lets_its_threads_move_when_asked() {
    let out = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args(["demo", "--cpus", "all", "--no-fio"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("threads: on any CPU") && stdout.contains("all data verified"), "{stdout}");
}

#[test]
fn demo_refuses_bad_arguments() {
    let out = Command::new(env!("CARGO_BIN_EXE_lanbus")).args(["demo", "--loss", "0.9"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--loss"));
}

/// Logs written to a file or a pipe (a daemon under systemd, `2> log`) carry no colour escapes;
/// `--log-format json` writes one JSON object per line.
#[test]
fn logs_to_a_file_are_plain_text_or_json() {
    let run = |format: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_lanbus"))
            .args(["-v", "--log-format", format, "demo", "--size-mib", "8", "--no-fio"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{stderr}");
        assert!(stderr.contains("host: exporting"), "the host's notices are logged: {stderr}");
        assert!(!stderr.contains('\u{1b}'), "an escape character in a log written to a pipe: {stderr:?}");
        stderr
    };
    run("text");
    for line in run("json").lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["level"].is_string() && v["fields"].is_object(), "{line}");
    }
}
