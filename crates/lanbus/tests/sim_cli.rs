//! `lanbus sim ...` through the binary: exit status, last line, files.

use std::path::PathBuf;
use std::process::{Command, Output};

fn lanbus(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lanbus")).args(args).output().expect("run lanbus")
}

fn last_line(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().to_string()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lanbus-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

const FAULTS: [&str; 10] =
    ["--loss", "0.05", "--reorder", "0.02", "--duplicate", "0.01", "--corrupt", "0.002", "--seed", "7"];

#[test]
fn transfer_with_faults_ends_with_the_clean_line_and_is_deterministic() {
    let mut args = vec!["sim", "transfer", "--messages", "20000"];
    args.extend(FAULTS);
    let first = lanbus(&args);
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    assert_eq!(last_line(&first), "delivered=20000 lost=0 duplicated=0 reordered=0 corrupted=0");
    let stdout = String::from_utf8_lossy(&first.stdout);
    assert!(stdout.contains("retransmitted="), "{stdout}");
    let second = lanbus(&args);
    assert_eq!(first.stdout, second.stdout, "same seed, same output");
    let mut other = args.clone();
    *other.last_mut().unwrap() = "8";
    let third = lanbus(&other);
    assert!(third.status.success());
    assert_ne!(first.stdout, third.stdout, "another seed, another run");
}

#[test]
fn transfer_reports_corruption_when_the_checksum_is_off() {
    // The wire flips bits and has no FCS: only the transport's checksum stops them. Without it,
    // the command must see the damage, say so in the last line and fail.
    let out = lanbus(&[
        "sim",
        "transfer",
        "--messages",
        "20000",
        "--corrupt",
        "0.02",
        "--seed",
        "3",
        "--no-checksum",
    ]);
    assert!(!out.status.success());
    let line = last_line(&out);
    assert!(line.starts_with("delivered="), "{line}");
    assert_ne!(line, "delivered=20000 lost=0 duplicated=0 reordered=0 corrupted=0");
}

#[test]
fn transfer_rejects_bad_probabilities() {
    let out = lanbus(&["sim", "transfer", "--loss", "1.5"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("between 0 and 1"));
}

#[test]
fn latency_vs_loss_writes_csv_and_png() {
    let dir = temp_dir("latency");
    let out = lanbus(&[
        "sim",
        "latency-vs-loss",
        "--messages",
        "20000",
        "--loss-rates",
        "0,1e-3",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let csv = std::fs::read_to_string(dir.join("latency_vs_loss.csv")).unwrap();
    let mut lines = csv.lines();
    assert_eq!(
        lines.next(),
        Some("loss_rate,mean_latency_us,p99_latency_us,base_rtt_us,goodput_gbps,retransmitted_frames")
    );
    assert_eq!(lines.count(), 2);
    let png = std::fs::read(dir.join("latency_vs_loss.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    // The paper's stated result is printed beside lanbus's.
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("paper (Sec. 4): up to loss 1e-5, mean and 99% latency are about the round trip"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn multi_session_writes_csv_and_png() {
    let dir = temp_dir("multi");
    let out = lanbus(&[
        "sim",
        "multi-session",
        "--sessions",
        "1,4",
        "--duration-ms",
        "30",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let csv = std::fs::read_to_string(dir.join("multi_session.csv")).unwrap();
    let mut lines = csv.lines();
    assert_eq!(
        lines.next(),
        Some(
            "sessions,utilization,rate_control,mean_throughput_ratio,p10_throughput_ratio,switch_drops,\
             retransmitted_frames,ideal_mean_throughput_ratio,line_utilization"
        )
    );
    let rows: Vec<&str> = lines.collect();
    assert_eq!(rows.len(), 4, "{rows:?}");
    assert!(rows.iter().any(|r| r.starts_with("4,0.2807,false,")), "{rows:?}");
    assert!(rows.iter().any(|r| r.starts_with("4,0.2807,true,")), "{rows:?}");
    let png = std::fs::read(dir.join("multi_session.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("128 B TLPs, one per 186 B frame"), "{text}");
    assert!(text.contains("(1640666 B on the line"), "{text}");
    assert!(
        text.contains("paper (Sec. 4): without congestion control, a mean ratio of 0.9 or more needs utilisation 0.20 or less"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn multi_session_keeps_the_jumbo_frames_reachable() {
    let dir = temp_dir("jumbo");
    let args = |frames: &'static str| {
        ["sim", "multi-session", "--sessions", "2", "--duration-ms", "20", "--frames", frames, "--out"]
    };
    let mut jumbo: Vec<&str> = args("jumbo").to_vec();
    jumbo.push(dir.to_str().unwrap());
    let out = lanbus(&jumbo);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("64 KiB messages over 1500 B frames"), "{text}");
    assert_eq!(csv_rows(&dir).len(), 2);
    let mut bad: Vec<&str> = args("huge").to_vec();
    bad.push(dir.to_str().unwrap());
    let bad = lanbus(&bad);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--frames"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn multi_session_at_scale_sets_each_utilisation_and_reports_the_reach() {
    let dir = temp_dir("scale");
    let out = lanbus(&[
        "sim",
        "multi-session",
        "--hosts",
        "16",
        "--utilization",
        "0.1,0.3",
        "--duration-ms",
        "40",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("16 hosts sending 1 MB bursts") && text.contains("up to utilisation"), "{text}");
    assert!(text.contains("an ideal fabric"), "{text}");
    // The ideal fabric's ratio is the same for both runs of a point (the same bursts), at most 1,
    // and falls with utilisation.
    let ideal = |prefix: &str| -> f64 {
        let row = csv_rows(&dir).into_iter().find(|r| r.starts_with(prefix)).unwrap();
        row.split(',').nth(7).unwrap().parse().unwrap()
    };
    assert_eq!(ideal("16,0.1000,false,"), ideal("16,0.1000,true,"));
    assert!(ideal("16,0.1000,false,") <= 1.0 && ideal("16,0.3000,false,") < ideal("16,0.1000,false,"));
    let csv = std::fs::read_to_string(dir.join("multi_session.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), 4, "{rows:?}");
    for prefix in ["16,0.1000,false,", "16,0.3000,false,", "16,0.1000,true,", "16,0.3000,true,"] {
        assert!(rows.iter().any(|r| r.starts_with(prefix)), "{prefix} in {rows:?}");
    }
    let bad = lanbus(&[
        "sim",
        "multi-session",
        "--hosts",
        "4",
        "--utilization",
        "0",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--utilization"));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn csv_rows(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("multi_session.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .map(String::from)
        .collect()
}

#[test]
fn paths_compares_four_paths_with_one_lossy_and_one_cut_deterministically() {
    let dir = temp_dir("paths");
    let args = ["sim", "paths", "--mib", "4", "--messages", "400", "--out", dir.to_str().unwrap()];
    let first = lanbus(&args);
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let text = String::from_utf8_lossy(&first.stdout).to_string();
    for line in ["three clean paths", "one at loss 0.05", "one of four cut"] {
        assert!(text.contains(line), "{text}");
    }
    assert!(text.contains("failovers 1"), "the cut path was taken down: {text}");
    assert_eq!(std::fs::read_to_string(dir.join("paths.txt")).unwrap(), text);
    assert_eq!(lanbus(&args).stdout, first.stdout, "same seed, same output");
    let bad = lanbus(&["sim", "paths", "--loss", "1.5"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--loss"));
    let _ = std::fs::remove_dir_all(&dir);
}
