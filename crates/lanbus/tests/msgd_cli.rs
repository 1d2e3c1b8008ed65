//! `lanbus msgd` as processes over udp on loopback (no root): processes of two nodes attach to
//! their daemons and exchange eager and rendezvous messages; a daemon killed with SIGKILL gives
//! its processes errors, not hangs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lanbus_msg::{Config, Match, Source};
use lanbus_node::msg::MsgError;
use lanbus_node::msgd::MsgClient;

const T: Duration = Duration::from_secs(20);

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn msgd(port: &str, socket: &Path, log: &Path) -> Daemon {
    let log = std::fs::File::create(log).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_lanbus"))
        .args(["msgd", "--port", port, "--socket"])
        .arg(socket)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    Daemon(child)
}

fn attach(socket: &Path) -> MsgClient {
    let t = Instant::now();
    loop {
        match MsgClient::connect(socket, Config::default()) {
            Ok(c) => return c,
            Err(e) => assert!(t.elapsed() < T, "attaching to {}: {e}", socket.display()),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn free_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn processes_on_two_daemons_exchange_messages_and_a_killed_daemon_fails_them() {
    let dir: PathBuf = std::env::temp_dir().join(format!("lanbus-msgd-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (p, q) = (free_port(), free_port());
    let (sa, sb) = (dir.join("a.sock"), dir.join("b.sock"));
    let _a = msgd(&format!("udp:127.0.0.1:{p},peer=127.0.0.1:{q}"), &sa, &dir.join("a.log"));
    let mut b = msgd(&format!("udp:127.0.0.1:{q},peer=127.0.0.1:{p}"), &sb, &dir.join("b.log"));
    let mut ca = attach(&sa);
    let cb = attach(&sb);
    let to_b = cb.addr();
    let echo = std::thread::spawn(move || {
        let mut cb = cb;
        for _ in 0..2 {
            let (st, data, _) = cb.recv(Match::any_tag(Source::Any, 5), 1 << 20, T).unwrap();
            cb.send(st.source, 5, st.tag, data, T).unwrap();
        }
        cb
    });
    for len in [64usize, 200_000] {
        let data: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
        ca.send(to_b, 5, len as u64, data.clone(), T).unwrap();
        let (_, back, _) = ca.recv(Match::exact(Source::Only(to_b), 5, len as u64), 1 << 20, T).unwrap();
        assert!(back == data, "{len} bytes came back intact");
    }
    let mut cb = echo.join().unwrap();
    // The daemon dies without a word: its process's calls fail instead of waiting.
    b.0.kill().unwrap();
    b.0.wait().unwrap();
    let r = cb.irecv(Match::any_tag(Source::Any, 5), 8).unwrap_or_else(|e| panic!("{e}"));
    let t = Instant::now();
    assert!(matches!(cb.wait(r, T), Err(MsgError::DaemonGone)));
    assert!(t.elapsed() < Duration::from_secs(2));
    let log = std::fs::read_to_string(dir.join("a.log")).unwrap();
    assert!(log.contains("serving processes at"), "{log}");
    drop(ca);
    let _ = std::fs::remove_dir_all(&dir);
}
