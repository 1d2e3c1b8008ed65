//! `lanbus bench nic` for one short run over afpacket (root): iperf3 through the remote NIC, the
//! direct veth beside it, and the two floors, the bare relay between the TAPs (`tunnel:afpacket`)
//! and the port's one-way rate. Without root, or without iperf3 (the test command installs it),
//! it skips and says why.

use std::process::Command;

#[test]
fn bench_nic_measures_the_nic_the_veth_and_both_floors() {
    if let Err(skip) = lanbus_port::netns::check_root() {
        eprintln!("skipped: {skip}");
        return;
    }
    if Command::new("iperf3").arg("--version").output().is_err() {
        eprintln!("skipped: iperf3 is not installed (Debian package iperf3)");
        return;
    }
    let id = std::process::id();
    let json = std::env::temp_dir().join(format!("lanbus-bench-nic-{id}.json"));
    let png = std::env::temp_dir().join(format!("lanbus-bench-nic-{id}"));
    let out = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args(["bench", "nic", "--ports", "afpacket", "--runs", "1", "--seconds", "1", "--json"])
        .arg(&json)
        .arg("--png")
        .arg(&png)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    let plot = png.with_file_name(format!("lanbus-bench-nic-{id}-tcp.png"));
    assert!(std::fs::metadata(&plot).is_ok_and(|m| m.len() > 1000), "{} was drawn", plot.display());
    let _ = std::fs::remove_file(&plot);
    let rows = v["rows"].as_array().unwrap();
    let row = |name: &str, test: &str| {
        rows.iter()
            .find(|r| r["name"] == name && r["test"] == test)
            .unwrap_or_else(|| panic!("no {name} {test}: {v}"))
    };
    for test in ["tcp1", "tcp4"] {
        for name in ["peer:veth", "afpacket", "tunnel:afpacket"] {
            let g = row(name, test)["value"].as_f64().unwrap();
            assert!(g > 0.05, "{name} {test}: {g} Gbit/s");
        }
        let nic = row("afpacket", test);
        assert!(nic["ratio_vs_tunnel"].as_f64().is_some_and(|r| r > 0.0), "{nic}");
        assert!(nic["ratio_vs_veth"].as_f64().is_some_and(|r| r > 0.0), "{nic}");
    }
    // The tunnel is a floor for the TCP tests only; the NIC's packet rates are measured.
    assert!(rows.iter().all(|r| !(r["name"] == "tunnel:afpacket" && r["test"] == "udp64")), "{v}");
    assert!(row("afpacket", "udp64")["value"].as_f64().is_some_and(|p| p > 0.0), "{v}");
    let raw = rows.iter().find(|r| r["name"] == "raw:afpacket").expect("the port's floor");
    assert!(raw["value"].as_f64().is_some_and(|g| g > 0.0), "{raw}");
}
