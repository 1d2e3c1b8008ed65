//! The processes of `lanbus bench transport` over udp on loopback (no root, no namespaces): an
//! echo server and a ping-pong client, a sink and a streaming client, a raw echo server and a raw
//! ping client, as the bench runs them.

use std::io::{BufRead, BufReader};
use std::net::UdpSocket;
use std::process::{Child, Command, Stdio};

/// Two free loopback UDP ports (closed again; a parallel test could take one, which only makes
/// this test fail to start, loudly).
fn two_ports() -> (u16, u16) {
    let a = UdpSocket::bind("127.0.0.1:0").unwrap();
    let b = UdpSocket::bind("127.0.0.1:0").unwrap();
    (a.local_addr().unwrap().port(), b.local_addr().unwrap().port())
}

const A_MAC: &str = "02:00:00:00:aa:01";
const B_MAC: &str = "02:00:00:00:bb:02";

fn spec(me: u16, my_mac: &str, peer: u16, peer_mac: &str) -> String {
    format!("udp:127.0.0.1:{me},mac={my_mac},peer={peer_mac}@127.0.0.1:{peer}")
}

fn server(role: &str, spec: &str, extra: &[&str]) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args(["bench", "transport-peer", "--port", spec, "--peer", A_MAC, "--role", role])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the server");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    child
}

fn client(role: &str, spec: &str, extra: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args(["bench", "transport-peer", "--port", spec, "--peer", B_MAC, "--role", role])
        .args(["--seconds", "0.2"])
        .args(extra)
        .output()
        .expect("run the client");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON line")
}

fn stop(mut child: Child) {
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}

#[test]
fn ping_pong_and_streaming_between_two_processes() {
    let (a, b) = two_ports();
    let (sa, sb) = (spec(a, A_MAC, b, B_MAC), spec(b, B_MAC, a, A_MAC));
    let echo = server("echo", &sb, &[]);
    let v = client("ping", &sa, &["--size", "64", "--rounds", "300"]);
    stop(echo);
    assert_eq!(v["rounds"], 300);
    let (p50, p99) = (v["p50_us"].as_f64().unwrap(), v["p99_us"].as_f64().unwrap());
    assert!(p50 > 0.0 && p50 <= p99, "{v}");

    let sink = server("sink", &sb, &["--size", "1024"]);
    let v = client("stream", &sa, &["--size", "1024"]);
    stop(sink);
    // At least the first window (1 MiB) was delivered, checked and credited.
    assert!(v["messages"].as_u64().unwrap() >= 1024, "{v}");
    assert!(v["msgs_per_s"].as_f64().unwrap() > 0.0, "{v}");
}

#[test]
fn raw_round_trips_between_two_processes() {
    let (a, b) = two_ports();
    let (sa, sb) = (spec(a, A_MAC, b, B_MAC), spec(b, B_MAC, a, A_MAC));
    let echo = server("raw-echo", &sb, &[]);
    let v = client("raw-ping", &sa, &["--size", "1024", "--rounds", "300"]);
    stop(echo);
    assert_eq!(v["rounds"], 300);
    let (p50, p99) = (v["p50_us"].as_f64().unwrap(), v["p99_us"].as_f64().unwrap());
    assert!(p50 > 0.0 && p50 <= p99, "{v}");

    // Without an echo server the client says so instead of waiting forever.
    let out = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args(["bench", "transport-peer", "--port", &sa, "--peer", B_MAC, "--role", "raw-ping"])
        .output()
        .expect("run the client");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("came back from no echo server"), "{out:?}");

    // A message longer than the port's MTU goes as several frames, answered once all came.
    let echo = server("raw-echo", &sb, &[]);
    let v = client("raw-ping", &sa, &["--size", "5000", "--rounds", "100"]);
    assert_eq!(v["rounds"], 100, "{v}");
    assert!(v["frames"].as_u64().unwrap() >= 2, "{v}");
    // One of a few frames still gets its answer in between.
    let v = client("raw-ping", &sa, &["--size", "100", "--rounds", "50"]);
    assert_eq!((v["rounds"].as_u64(), v["frames"].as_u64()), (Some(50), Some(1)), "{v}");

    // A message of more than a thousand frames is refused up front.
    let out = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args([
            "bench",
            "transport-peer",
            "--port",
            &sa,
            "--peer",
            B_MAC,
            "--role",
            "raw-ping",
            "--size",
            "100000000",
        ])
        .output()
        .expect("run the client");
    stop(echo);
    assert!(String::from_utf8_lossy(&out.stderr).contains("raw frames at MTU"), "{out:?}");
}
