//! `lanbus bench msg --quick` on a veth pair (root): the messaging engine's ping-pong over udp
//! and afpacket, eager and rendezvous sizes, with NetPIPE's TCP ping-pong as the peer when
//! NPtcp is installed (the test command installs it). Without root it skips and says why.

use std::process::Command;

#[test]
fn bench_msg_measures_both_ports_and_the_peer() {
    if let Err(skip) = lanbus_port::netns::check_root() {
        eprintln!("skipped: {skip}");
        return;
    }
    let peer = Command::new("NPtcp").arg("-h").output().is_ok();
    let json = std::env::temp_dir().join(format!("lanbus-bench-msg-{}.json", std::process::id()));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lanbus"));
    let png = std::env::temp_dir().join(format!("lanbus-bench-msg-{}", std::process::id()));
    cmd.args(["bench", "msg", "--quick", "--sizes", "64,65536", "--protocols", "auto,eager", "--bandwidth"])
        .args(["--window", "8", "--json"])
        .arg(&json)
        .arg("--png")
        .arg(&png);
    if !peer {
        eprintln!("NPtcp is not installed (Debian package netpipe-tcp): measuring without the peer");
        cmd.arg("--no-peer");
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    for plot in ["latency", "bandwidth"] {
        let file = png.with_file_name(format!("lanbus-bench-msg-{}-{plot}.png", std::process::id()));
        assert!(std::fs::metadata(&file).is_ok_and(|m| m.len() > 1000), "{} was drawn", file.display());
        let _ = std::fs::remove_file(&file);
    }
    let rows = v["rows"].as_array().unwrap();
    let find = |name: &str, protocol: &str, metric: &str, size: u64| {
        rows.iter()
            .find(|r| {
                r["name"] == name
                    && r["metric"] == metric
                    && r["size_bytes"] == size
                    && (protocol.is_empty() || r["protocol"] == protocol)
            })
            .and_then(|r| r["value"].as_f64())
    };
    let value = |name: &str, protocol: &str, metric: &str, size: u64| {
        find(name, protocol, metric, size)
            .unwrap_or_else(|| panic!("no {name} {protocol} {metric} at {size}: {v}"))
    };
    // The bare ports' floors: a 64-byte frame's one-way time, the one-way rate.
    for kind in ["udp", "afpacket"] {
        let raw = format!("raw:{kind}");
        let us = value(&raw, "", "latency_us", 64);
        assert!(us > 0.0 && us < 10_000.0, "{raw}: {us} µs");
        assert!(
            find(&raw, "", "latency_us", 65536).is_none(),
            "{raw}: no floor for a message of many frames"
        );
        let rate = rows.iter().find(|r| r["name"] == raw.as_str() && r["metric"] == "bw_mb_per_s");
        assert!(rate.and_then(|r| r["value"].as_f64()).is_some_and(|m| m > 0.0), "{raw} rate: {v}");
    }
    let daemon =
        rows.iter().any(|r| r["mode"] == "daemon" && r["metric"] == "latency_us" && r["size_bytes"] == 65536);
    assert!(daemon, "daemon-mode rows: {v}");
    for kind in ["udp", "afpacket"] {
        for size in [64, 65536] {
            let us = value(kind, "auto", "latency_us", size);
            assert!(us > 0.0 && us < 100_000.0, "{kind} {size}: {us} µs");
            assert!(value(kind, "auto", "bw_mb_per_s", size) > 0.0);
            if peer {
                assert!(value(kind, "auto", "latency_vs_nptcp", size) > 0.0);
                // NetPIPE's streaming mode sometimes stalls; the bench then reports no figure
                // for it (and says so), so only its ping-pong is required here.
                if let Some(r) = find(kind, "auto", "bw_vs_nptcp", size) {
                    assert!(r > 0.0);
                }
            }
        }
        assert!(value(kind, "eager", "latency_us", 64) > 0.0);
        assert!(
            find(kind, "eager", "latency_us", 65536).is_none(),
            "65536 bytes are too many for one eager record"
        );
    }
    if peer {
        assert!(value("peer:NPtcp", "", "latency_us", 64) > 0.0);
        if find("peer:NPtcp", "", "bw_mb_per_s", 65536).is_none() {
            eprintln!("NPtcp's streaming run gave no figures: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
}

/// `--mpi`: the ping-pong built with mpicc and NetPIPE's NPopenmpi under mpirun, through the
/// lanbus provider in both modes and, as the peer, through Open MPI's tcp BTL; each job's bytes
/// counted on the veth.
#[test]
fn bench_msg_measures_open_mpi_over_lanbus_and_its_tcp_btl() {
    if let Err(skip) = lanbus_port::netns::check_root() {
        eprintln!("skipped: {skip}");
        return;
    }
    let provider = std::path::Path::new(env!("CARGO_BIN_EXE_lanbus")).with_file_name("liblanbus_fi.so");
    let mpi = Command::new("mpicc").arg("--version").output().is_ok_and(|o| o.status.success());
    assert!(
        mpi && provider.exists(),
        "scripts/test installs Open MPI and builds the provider ({}) before the tests",
        provider.display()
    );
    let json = std::env::temp_dir().join(format!("lanbus-bench-msg-mpi-{}.json", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args(["bench", "msg", "--quick", "--ports", "afpacket", "--sizes", "64,65536", "--mpi"])
        .args(["--bandwidth", "--window", "8", "--json"])
        .arg(&json)
        .arg("--png")
        .arg(std::env::temp_dir().join(format!("lanbus-bench-msg-mpi-{}", std::process::id())))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    for plot in ["latency", "bandwidth"] {
        let _ = std::fs::remove_file(
            std::env::temp_dir().join(format!("lanbus-bench-msg-mpi-{}-{plot}.png", std::process::id())),
        );
    }
    let rows = v["rows"].as_array().unwrap();
    let find = |name: &str, mode: &str, metric: &str| {
        rows.iter()
            .find(|r| r["name"] == name && r["metric"] == metric && (mode.is_empty() || r["mode"] == mode))
    };
    for mode in ["direct", "daemon"] {
        let lat = find("mpi:lanbus-afpacket", mode, "latency_us")
            .and_then(|r| r["value"].as_f64())
            .unwrap_or_else(|| panic!("no {mode} row through Open MPI: {v}"));
        assert!(lat > 0.0 && lat < 100_000.0, "{mode}: {lat} µs");
        let bytes = find("mpi:lanbus-afpacket", mode, "veth_bytes").and_then(|r| r["value"].as_f64());
        assert!(bytes.is_some_and(|b| b > 65536.0), "{mode}: the job crossed the veth: {bytes:?}");
    }
    let netpipe = rows.iter().any(|r| {
        r["name"] == "mpi:lanbus-afpacket" && r["program"] == "NPopenmpi" && r["metric"] == "latency_us"
    });
    assert!(netpipe, "NPopenmpi through the provider: {v}");
    let peer = find("peer:ompi-tcp", "", "latency_us").and_then(|r| r["value"].as_f64());
    assert!(peer.is_some_and(|us| us > 0.0), "the tcp BTL peer ran: {v}");
    assert!(find("mpi:lanbus-afpacket", "direct", "latency_vs_ompi_tcp").is_some());
    assert!(find("raw:afpacket", "", "latency_vs_ompi_tcp").is_some(), "the floor against the tcp BTL: {v}");
}
