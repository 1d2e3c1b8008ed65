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
    cmd.args(["bench", "msg", "--quick", "--sizes", "64,65536", "--json"]).arg(&json);
    if !peer {
        eprintln!("NPtcp is not installed (Debian package netpipe-tcp): measuring without the peer");
        cmd.arg("--no-peer");
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    let rows = v["rows"].as_array().unwrap();
    let value = |name: &str, metric: &str, size: u64| {
        rows.iter()
            .find(|r| r["name"] == name && r["metric"] == metric && r["size_bytes"] == size)
            .and_then(|r| r["value"].as_f64())
            .unwrap_or_else(|| panic!("no {name} {metric} at {size}: {v}"))
    };
    for kind in ["udp", "afpacket"] {
        for size in [64, 65536] {
            let us = value(kind, "latency_us", size);
            assert!(us > 0.0 && us < 100_000.0, "{kind} {size}: {us} µs");
            if peer {
                assert!(value(kind, "latency_vs_nptcp", size) > 0.0);
            }
        }
    }
    if peer {
        assert!(value("peer:NPtcp", "latency_us", 64) > 0.0);
    }
}
