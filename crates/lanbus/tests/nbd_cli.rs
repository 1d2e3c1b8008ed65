//! `lanbus nbd serve`: serves a file and a RAM disk, and on SIGTERM/SIGINT flushes and exits 0.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lanbus_nbd::Client;

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lanbus-nbd-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The server process; killed if a test fails before stopping it.
struct Proc(Option<Child>);

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn start(args: &[&str], socket: &Path) -> Proc {
    let child = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args(["nbd", "serve"])
        .args(args)
        .arg("--socket")
        .arg(socket)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let child = Proc(Some(child));
    let t = Instant::now();
    while Client::connect_unix(socket, "export").is_err() {
        assert!(t.elapsed() < Duration::from_secs(20), "server never came up");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn stop(mut proc: Proc, signal: &str) -> String {
    let child = proc.0.take().unwrap();
    let ok = Command::new("kill").args([signal, &child.id().to_string()]).status().unwrap().success();
    assert!(ok, "kill {signal}");
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status);
    stderr
}

#[test]
fn file_export_keeps_its_data_after_sigterm() {
    let dir = scratch("file");
    let image = dir.join("disk.img");
    std::fs::write(&image, vec![0u8; 4 << 20]).unwrap();
    let socket = dir.join("nbd.sock");
    let child = start(&["--file", image.to_str().unwrap()], &socket);
    let mut c = Client::connect_unix(&socket, "export").unwrap();
    assert_eq!(c.size_bytes(), 4 << 20);
    c.write(1 << 20, &[0xa5; 65536], false).unwrap();
    c.disconnect().unwrap();
    let log = stop(child, "-TERM");
    assert!(log.contains("stopped"), "{log}");
    let bytes = std::fs::read(&image).unwrap();
    assert!(bytes[1 << 20..(1 << 20) + 65536].iter().all(|&b| b == 0xa5));
    assert!(!socket.exists(), "socket file removed");
    // A restarted server (over TCP this time) serves what was written before the stop.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let child = start(&["--file", image.to_str().unwrap(), "--tcp", &addr], &socket);
    let mut c = Client::connect_tcp(addr.parse().unwrap(), "export").unwrap();
    let mut back = vec![0u8; 65536];
    c.read(1 << 20, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0xa5));
    c.disconnect().unwrap();
    stop(child, "-TERM");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ram_export_stops_on_sigint_and_bad_arguments_fail() {
    let dir = scratch("ram");
    let socket = dir.join("nbd.sock");
    let child = start(&["--ram", "8M", "--read-only"], &socket);
    let mut c = Client::connect_unix(&socket, "").unwrap();
    assert_eq!(c.size_bytes(), 8 << 20);
    assert!(c.write(0, &[1; 512], false).is_err(), "read-only");
    drop(c);
    stop(child, "-INT");
    let bad = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args(["nbd", "serve", "--ram", "lots", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a number"));
    std::fs::remove_dir_all(&dir).unwrap();
}
