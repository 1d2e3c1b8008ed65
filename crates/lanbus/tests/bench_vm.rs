//! `lanbus bench vm` once with small transfers (root, QEMU, qemu-storage-daemon, fio): every row
//! gets its figures from a booted guest or fio, and each lanbus row its ratio to its peer. Without
//! them it skips and says why.

use std::path::Path;
use std::process::Command;

mod common;
use common::{guest, have};

#[test]
fn every_row_is_measured_and_compared_with_its_peer() {
    if let Some(why) = guest::skip_reason() {
        eprintln!("{why}");
        return;
    }
    for program in ["qemu-storage-daemon", "qemu-nbd", "fio", "python3"] {
        if !have(program) {
            eprintln!("skipped: needs {program} (scripts/setup installs it)");
            return;
        }
    }
    let dir = std::env::temp_dir().join(format!("lanbus-bench-vm-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("vm.json");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/guest");
    let out = Command::new(common::lanbus_path())
        .args(["bench", "vm", "--runs", "1", "--mib", "8", "--guest-script"])
        .arg(&script)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let rows = v["rows"].as_array().unwrap();
    let value = |name: &str, metric: &str| {
        rows.iter()
            .find(|r| r["name"] == name && r["metric"] == metric)
            .unwrap_or_else(|| panic!("no {name} {metric}: {v}"))
    };
    for (name, metrics) in [
        ("blk:lanbus", ["read_mb_per_s", "write_mb_per_s"]),
        ("blk:qsd", ["read_mb_per_s", "write_mb_per_s"]),
        ("blk:nbd-tcp", ["read_mb_per_s", "write_mb_per_s"]),
        ("fabric:lanbus-nbd", ["read_mb_per_s", "write_mb_per_s"]),
        ("fabric:qemu-nbd", ["read_mb_per_s", "write_mb_per_s"]),
        ("net:lanbus", ["fetch_mb_per_s", "post_mb_per_s"]),
        ("net:tap", ["fetch_mb_per_s", "post_mb_per_s"]),
    ] {
        for m in metrics {
            assert!(value(name, m)["value"].as_f64().unwrap() > 0.0, "{name} {m}: {v}");
        }
    }
    assert!(value("blk:lanbus", "read_mb_per_s")["ratio_vs_qsd"].as_f64().unwrap() > 0.0);
    assert!(value("net:lanbus", "fetch_mb_per_s")["ratio_vs_tap"].as_f64().unwrap() > 0.0);
    assert!(value("fabric:lanbus-nbd", "write_mb_per_s")["ratio_vs_qemu-nbd"].as_f64().unwrap() > 0.0);
    assert!(stderr.contains("the fabric alone"), "{stderr}");
}
