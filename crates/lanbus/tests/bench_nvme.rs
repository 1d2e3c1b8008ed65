//! `lanbus bench nvme` with several MTUs and runs in turns (root, fio, qemu-nbd): every lanbus row
//! that crosses the veth is measured at each MTU, its floor too, the TCP peer at its own MTU, and
//! the figures name their MTUs. Without root, fio or qemu-nbd it skips and says why.

use std::process::{Command, Output};

/// Runs `lanbus bench nvme` with `args` in a scratch directory (`name`), writing its JSON there;
/// the command's output and the report.
fn bench(name: &str, args: &[&str]) -> (Output, serde_json::Value) {
    let dir = std::env::temp_dir().join(format!("lanbus-bench-nvme-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("nvme.json");
    let out = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args(["bench", "nvme"])
        .args(args)
        .arg("--json")
        .arg(&json)
        .arg("--png")
        .arg(dir.join("plot"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    (out, v)
}

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
    if Command::new("qemu-nbd").arg("--version").output().is_err() {
        eprintln!("skipped: needs qemu-nbd (Debian package qemu-utils; .ci/run installs it)");
        return;
    }
    let args = "--quick --runs 2 --only afpacket,peer:nbd-tcp --block-sizes 4k --rw randread \
                --size-mib 16 --mtu 1500,9000 --peer-mtu 9000";
    let (out, v) = bench("mtus", &args.split_whitespace().collect::<Vec<_>>());
    let rows = v["rows"].as_array().unwrap();
    for mtu in [1500, 9000] {
        let find = |name: &str, metric: &str| {
            rows.iter().any(|r| r["name"] == name && r["metric"] == metric && r["mtu"] == mtu)
        };
        assert!(find("afpacket", "mb_per_s"), "afpacket at MTU {mtu}: {v}");
        assert!(find("raw:afpacket", "mb_per_s_one_way"), "the floor at MTU {mtu}: {v}");
        assert_eq!(find("peer:nbd-tcp", "mb_per_s"), mtu == 9000, "the peer at MTU {mtu} alone: {v}");
        // Both lanbus rows are compared with the peer at its one MTU.
        let ratio = rows.iter().find(|r| {
            r["name"] == "afpacket"
                && r["metric"] == "ratio_vs_nbd_tcp"
                && r["mtu"] == mtu
                && r["peer_mtu"] == 9000
        });
        assert!(
            ratio.and_then(|r| r["value"].as_f64()).is_some_and(|x| x > 0.0),
            "the ratio at MTU {mtu}: {v}"
        );
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
    assert!(!stderr.contains("peer:nbd-tcp (MTU 1500)"), "{stderr}");
}

#[test]
fn a_peer_mtu_without_the_peer_is_refused() {
    if Command::new("fio").arg("--version").output().is_err() {
        eprintln!("skipped: needs fio (Debian package fio; .ci/run installs it)");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args(["bench", "nvme", "--quick", "--only", "afpacket", "--peer-mtu", "1500"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--peer-mtu sets the MTUs of the peer:nbd-tcp row"), "{stderr}");
}

/// Every lanbus row counts the copies its data makes where it crosses from one part to the next
/// (no root: the simulated wire and the in-process drive). A 64 KiB write with the queues and
/// data in host memory: fio's copy into the socket and the server's out of it (straight into
/// the driver's DMA memory), the backing file's; over the fabric also the frames built from host memory,
/// the port's copies each way and the completions taken out of frames; in process the
/// controller's copy out of host memory instead.
#[test]
fn copies_are_counted_where_the_data_crosses() {
    if Command::new("fio").arg("--version").output().is_err() {
        eprintln!("skipped: needs fio (Debian package fio; .ci/run installs it)");
        return;
    }
    let args = "--quick --only local,sim --cmb off --block-sizes 64k --rw randwrite --size-mib 16";
    let (_, v) = bench("copies", &args.split_whitespace().collect::<Vec<_>>());
    let rows = v["rows"].as_array().unwrap();
    let copies = |row: &str, stage: &str| {
        rows.iter()
            .find(|r| r["name"] == row && r["metric"] == "copies_per_byte" && r["stage"] == stage)
            .and_then(|r| r["value"].as_f64())
            .unwrap_or_else(|| panic!("no {stage} copies in {row}: {v}"))
    };
    let about = |x: f64, want: f64| (x - want).abs() < 0.05;
    for row in ["local", "sim"] {
        assert_eq!(copies(row, "socket"), 2.0, "{row}");
        // The payload goes from the socket straight into DMA memory: the driver copies only
        // queue entries.
        assert!(copies(row, "driver") < 0.01, "{row}: {}", copies(row, "driver"));
        assert!(about(copies(row, "backing"), 1.0), "{row}: {}", copies(row, "backing"));
        let stages = ["socket", "driver", "into_frames", "port", "out_of_frames", "controller", "backing"];
        let sum: f64 = stages.iter().map(|s| copies(row, s)).sum();
        assert!(about(copies(row, "all"), sum), "{row}: all {} against {sum}", copies(row, "all"));
    }
    assert!(about(copies("local", "controller"), 1.0), "{}", copies("local", "controller"));
    for stage in ["into_frames", "port", "out_of_frames"] {
        assert_eq!(copies("local", stage), 0.0, "{stage}");
    }
    // Over the fabric: frames built from host memory (once: a frame sent again is not built
    // again), copied into and out of the port (headers, acknowledgements and frames sent again
    // too), the completions taken out of frames (put together first where they span frames);
    // the drive writes what it read ahead where it lies.
    assert!(about(copies("sim", "into_frames"), 1.0), "{}", copies("sim", "into_frames"));
    assert!((2.0..4.0).contains(&copies("sim", "port")), "{}", copies("sim", "port"));
    assert!((0.99..3.5).contains(&copies("sim", "out_of_frames")), "{}", copies("sim", "out_of_frames"));
    assert!(copies("sim", "controller") < 0.05, "{}", copies("sim", "controller"));
}
