//! `lanbus bench nvme` with several MTUs and runs in turns (root, fio): every row that crosses
//! the veth is measured at each MTU, its floor too, and the figures name their MTU. Without root
//! or fio it skips and says why.

use std::process::Command;

#[test]
fn rows_over_the_veth_are_measured_at_every_mtu() {
    if let Err(skip) = lanbus_port::netns::check_root() {
        eprintln!("skipped: {skip}");
        return;
    }
    if Command::new("fio").arg("--version").output().is_err() {
        eprintln!("skipped: needs fio (Debian package fio; .ci/run installs it)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("lanbus-bench-nvme-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("nvme.json");
    let out = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args(["bench", "nvme", "--quick", "--runs", "2", "--only", "afpacket", "--block-sizes", "4k"])
        .args(["--rw", "randread", "--size-mib", "16", "--mtu", "1500,9000", "--json"])
        .arg(&json)
        .arg("--png")
        .arg(dir.join("plot"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let rows = v["rows"].as_array().unwrap();
    for mtu in [1500, 9000] {
        let find = |name: &str, metric: &str| {
            rows.iter().any(|r| r["name"] == name && r["metric"] == metric && r["mtu"] == mtu)
        };
        assert!(find("afpacket", "mb_per_s"), "afpacket at MTU {mtu}: {v}");
        assert!(find("raw:afpacket", "mb_per_s_one_way"), "the floor at MTU {mtu}: {v}");
    }
    // Each lanbus point splits its time into stages; the fabric's wait is never empty.
    let stage = |name: &str| {
        rows.iter()
            .find(|r| {
                r["name"] == "afpacket" && r["metric"] == "stage_us" && r["stage"] == name && r["mtu"] == 9000
            })
            .and_then(|r| r["value"].as_f64())
            .unwrap_or_else(|| panic!("no stage {name}: {v}"))
    };
    assert!(stage("fabric_and_device") > 0.0);
    for name in ["client_and_socket", "nbd_payload", "driver_copy", "backing", "nbd_reply"] {
        assert!(stage(name) >= 0.0);
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("run 2/2: afpacket (MTU 9000)"), "{stderr}");
}
