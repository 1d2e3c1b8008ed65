//! The TCP/IP stack server against Linux's own TCP/IP in another namespace (root): `lanbus
//! stackd` on one end of a veth pair whose interface has no kernel address, Linux on the other
//! end with its default offloads (so segments arrive coalesced and with partial checksums).
//!
//! - ping (ARP and ICMP echo);
//! - 200 MiB each way between `nc` and `lanbus stack send`/`recv`, sha256 equal;
//! - a file fetched from `python3 -m http.server`;
//! - 1,000 connections open at once through the client library, used and closed, with no state
//!   left in the server;
//! - the errors Linux would give: ECONNREFUSED, ECONNRESET after the peer's RST, ETIMEDOUT when the
//!   peer vanishes;
//! - a client killed mid-transfer: its connection ends at the peer, the server forgets it, and the
//!   next client works;
//! - real servers through the preload library and against Linux: nginx (a master and two
//!   workers) under wrk and curl, wrk beside a slow download (non-blocking writes that run out
//!   of room), with 10,000 connections dropped, clients and a worker killed;
//!   memcached (four threads) under memcslap; python's asyncio; nothing left in the server after.
//!
//! Without root it skips and says why.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lanbus_port::netns::{check_root, Netns};
use lanbus_stack::client::StackClient;
use lanbus_stack::CopyUnit;

mod common;
use common::{have, lanbus_path, ok, Daemon};

fn sha256(path: &Path) -> String {
    let out = ok(Command::new("sha256sum").arg(path).output(), "sha256sum");
    out.split_whitespace().next().unwrap_or_default().to_string()
}

const STACK_IP: Ipv4Addr = Ipv4Addr::new(10, 78, 0, 1);
const LINUX_IP: Ipv4Addr = Ipv4Addr::new(10, 78, 0, 2);
const STACK_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x78, 0, 0, 0, 0, 0, 1);
const LINUX_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x78, 0, 0, 0, 0, 0, 2);

struct Net {
    _stack: Netns,
    linux: Netns,
    linux_if: String,
    dir: PathBuf,
    socket: PathBuf,
    control: PathBuf,
    stackd: Daemon,
}

/// `test` tells two tests of one process apart.
fn build(test: char) -> Net {
    let tag = std::process::id() % 100_000;
    let stack = Netns::create(&format!("lbs{tag}{test}-stack")).expect("namespace");
    let linux = Netns::create(&format!("lbs{tag}{test}-linux")).expect("namespace");
    let (sif, lif) = (format!("lbs{tag}{test}s"), format!("lbs{tag}{test}l"));
    ok(
        Command::new("ip")
            .args([
                "link",
                "add",
                &sif,
                "netns",
                stack.name(),
                "type",
                "veth",
                "peer",
                "name",
                &lif,
                "netns",
                linux.name(),
            ])
            .output(),
        "veth pair",
    );
    ok(stack.ip(&["link", "set", &sif, "up"]), "stack side up");
    ok(linux.ip(&["addr", "add", &format!("{LINUX_IP}/24"), "dev", &lif]), "linux address");
    ok(
        linux.ip(&["-6", "addr", "add", &format!("{LINUX_IP6}/64"), "dev", &lif, "nodad"]),
        "linux IPv6 address",
    );
    ok(linux.ip(&["link", "set", &lif, "up"]), "linux side up");
    ok(linux.ip(&["link", "set", "lo", "up"]), "linux lo up");
    let dir = std::env::temp_dir().join(format!("lanbus-stack-daemons-{tag}{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (socket, control) = (dir.join("stack.sock"), dir.join("stack.ctl"));
    let stackd = stack
        .command(lanbus_path())
        .args(["stackd", "--port", &format!("afpacket:{sif}"), "--ip", &format!("{STACK_IP}/24")])
        .args(["--ip6", &format!("{STACK_IP6}/64")])
        .arg("--socket")
        .arg(&socket)
        .arg("--control")
        .arg(&control)
        // Short enough for the ETIMEDOUT check below, long enough that a segment dropped while
        // a thousand connections burst out at once is retransmitted (with the backoff) in time.
        .args(["--tcp-timeout", "15"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting lanbus stackd");
    let stackd = Daemon(stackd);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(socket.exists() && control.exists()) {
        assert!(Instant::now() < deadline, "lanbus stackd did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    Net { _stack: stack, linux, linux_if: lif, dir, socket, control, stackd }
}

impl Net {
    fn status(&self) -> serde_json::Value {
        let out = ok(
            Command::new(lanbus_path()).args(["status", "--json", "--control"]).arg(&self.control).output(),
            "lanbus status",
        );
        serde_json::from_str(out.trim()).expect("status JSON")
    }

    /// Waits for the server's status to satisfy `ok` (it is refreshed every 100 ms).
    fn settled(&self, what: &str, ok: impl Fn(&serde_json::Value) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let st = self.status();
            if ok(&st) {
                return;
            }
            assert!(Instant::now() < deadline, "{what}: {st}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn client(&self) -> StackClient {
        StackClient::attach(&self.socket, CopyUnit::DEFAULT).expect("attaching to lanbus stackd")
    }

    /// A thread in the Linux namespace serving `serve` on a listener at `port`.
    fn linux_server<T: Send + 'static>(
        &self,
        port: u16,
        serve: impl FnOnce(TcpListener) -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let name = self.linux.name().to_string();
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            lanbus_port::netns::enter(&name).expect("entering the namespace");
            let l = TcpListener::bind((LINUX_IP, port)).expect("binding in the Linux namespace");
            // Room for every connection of a test opened at once (std listens with a backlog of
            // 128; Linux drops the handshakes past it while the accepting thread waits for a
            // core, and a connection the stack saw open could then be reset).
            // SAFETY: listen(2) again on a listening socket only changes its backlog.
            let rc = unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&l), 4096) };
            assert_eq!(rc, 0, "listen: {}", std::io::Error::last_os_error());
            tx.send(()).unwrap();
            serve(l)
        });
        rx.recv_timeout(Duration::from_secs(10)).expect("the Linux listener");
        t
    }
}

#[test]
fn stack_server_against_linux_tcp() {
    if let Err(skip) = check_root() {
        eprintln!("skipped: {}", skip.0);
        return;
    }
    for tool in ["nc", "ping", "python3", "sha256sum"] {
        if !have(tool) {
            eprintln!("skipped: {tool} is not installed (scripts/setup installs it)");
            return;
        }
    }
    let net = build('a');

    // ARP and ICMP echo.
    ok(net.linux.exec("ping", &["-c", "3", "-i", "0.2", "-W", "2", &STACK_IP.to_string()]), "ping the stack");

    // 200 MiB each way through nc.
    let file = net.dir.join("200M.bin");
    ok(
        Command::new("sh")
            .arg("-c")
            .arg(format!("head -c 209715200 /dev/urandom > {}", file.display()))
            .output(),
        "random file",
    );
    let want = sha256(&file);
    let got = net.dir.join("from-stack.bin");
    let mut sink = net
        .linux
        .command("sh")
        .arg("-c")
        .arg(format!("exec timeout 120 nc -l -p 6001 > {}", got.display()))
        .spawn()
        .expect("nc -l");
    std::thread::sleep(Duration::from_millis(300));
    ok(
        Command::new(lanbus_path())
            .args(["stack", "send", &format!("{LINUX_IP}:6001"), "--socket"])
            .arg(&net.socket)
            .stdin(std::fs::File::open(&file).unwrap())
            .output(),
        "lanbus stack send",
    );
    assert!(sink.wait().unwrap().success());
    assert_eq!(sha256(&got), want, "200 MiB from the stack to Linux");
    // The same through a zero-copy connection: read straight into the shared send buffer.
    std::fs::remove_file(&got).unwrap();
    let mut sink = net
        .linux
        .command("sh")
        .arg("-c")
        .arg(format!("exec timeout 120 nc -l -p 6009 > {}", got.display()))
        .spawn()
        .expect("nc -l");
    std::thread::sleep(Duration::from_millis(300));
    ok(
        Command::new(lanbus_path())
            .args(["stack", "send", &format!("{LINUX_IP}:6009"), "--zero-copy", "--socket"])
            .arg(&net.socket)
            .stdin(std::fs::File::open(&file).unwrap())
            .output(),
        "lanbus stack send --zero-copy",
    );
    assert!(sink.wait().unwrap().success());
    assert_eq!(sha256(&got), want, "200 MiB from the stack to Linux, zero copy");
    let zero_copy = &net.status()["counters"];
    assert!(zero_copy["zero_copy_bytes"].as_u64().unwrap_or(0) >= 100 << 20, "{zero_copy}");
    let back = net.dir.join("to-stack.bin");
    let mut recv = Command::new(lanbus_path())
        .args(["stack", "recv", "6002", "--socket"])
        .arg(&net.socket)
        .stdout(std::fs::File::create(&back).unwrap())
        .spawn()
        .expect("lanbus stack recv");
    std::thread::sleep(Duration::from_millis(300));
    ok(
        net.linux
            .command("sh")
            .arg("-c")
            .arg(format!("timeout 120 nc -N {STACK_IP} 6002 < {}", file.display()))
            .output(),
        "nc to the stack",
    );
    assert!(recv.wait().unwrap().success());
    assert_eq!(sha256(&back), want, "200 MiB from Linux to the stack");

    // A file from python's http.server.
    let site = net.dir.join("site");
    std::fs::create_dir_all(&site).unwrap();
    let page: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(site.join("page.bin"), &page).unwrap();
    let http = Daemon(
        net.linux
            .command("python3")
            .args(["-m", "http.server", "8000", "--bind", &LINUX_IP.to_string()])
            .current_dir(&site)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 -m http.server"),
    );
    let mut fetched = None;
    let deadline = Instant::now() + Duration::from_secs(10);
    while fetched.is_none() && Instant::now() < deadline {
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "printf 'GET /page.bin HTTP/1.0\\r\\nHost: {LINUX_IP}\\r\\n\\r\\n' | {} stack send {LINUX_IP}:8000 --socket {}",
                lanbus_path(),
                net.socket.display()
            ))
            .output()
            .unwrap();
        if out.status.success() && out.stdout.starts_with(b"HTTP/1.0 200") {
            fetched = Some(out.stdout);
        } else {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let response = fetched.expect("python's http.server answered through the stack");
    let body = response.windows(4).position(|w| w == b"\r\n\r\n").map(|p| &response[p + 4..]).unwrap();
    assert!(body == &page[..], "the page arrived whole ({} of {} bytes)", body.len(), page.len());
    drop(http);

    // 1,000 connections open at once, each used and closed.
    const N: usize = 1000;
    let server = net.linux_server(6003, |l| {
        // All accepted first: every connection is open at the same time.
        let accepted: Vec<_> = (0..N).map(|_| l.accept().unwrap().0).collect();
        for mut s in accepted {
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let mut msg = Vec::new();
            s.read_to_end(&mut msg).unwrap();
            s.write_all(&msg).unwrap();
        }
    });
    let client = net.client();
    let mut conns = Vec::new();
    for _ in 0..N {
        conns.push(client.connect(SocketAddrV4::new(LINUX_IP, 6003)).expect("connect"));
    }
    net.settled("all open at once", |st| st["connections"].as_array().is_some_and(|a| a.len() >= N));
    for (i, c) in conns.iter_mut().enumerate() {
        c.write_all(format!("connection {i}").as_bytes()).unwrap();
        c.shutdown_write().unwrap();
    }
    for (i, c) in conns.iter_mut().enumerate() {
        c.set_read_timeout(Some(Duration::from_secs(60)));
        let mut back = String::new();
        c.read_to_string(&mut back).unwrap();
        assert_eq!(back, format!("connection {i}"));
    }
    server.join().unwrap();
    drop(conns);
    net.settled("every connection freed", |st| {
        st["connections"].as_array().is_some_and(|a| a.is_empty())
            && st["counters"]["connections_opened"] == st["counters"]["connections_freed"]
    });

    // The errors Linux gives.
    {
        let e = client.connect(SocketAddrV4::new(LINUX_IP, 6004)).err().expect("nobody listens on 6004");
        assert_eq!(e.raw_os_error(), Some(libc::ECONNREFUSED), "{e}");
        let server = net.linux_server(6005, |l| {
            let (s, _) = l.accept().unwrap();
            // SO_LINGER with a zero timeout: close sends RST.
            let linger = libc::linger { l_onoff: 1, l_linger: 0 };
            // SAFETY: setsockopt on our own socket with a correctly sized option.
            unsafe {
                use std::os::fd::AsRawFd;
                libc::setsockopt(
                    s.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    (&linger as *const libc::linger).cast(),
                    std::mem::size_of::<libc::linger>() as u32,
                );
            }
            drop(s);
        });
        let mut c = client.connect(SocketAddrV4::new(LINUX_IP, 6005)).unwrap();
        server.join().unwrap();
        let e = c.read(&mut [0u8; 16]).expect_err("reset by the peer");
        assert_eq!(e.raw_os_error(), Some(libc::ECONNRESET), "{e}");
        let server = net.linux_server(6006, |l| l.accept().map(|(s, _)| s).unwrap());
        let mut c = client.connect(SocketAddrV4::new(LINUX_IP, 6006)).unwrap();
        let _held = server.join().unwrap();
        ok(net.linux.ip(&["link", "set", &net.linux_if, "down"]), "the peer vanishes");
        c.write_all(b"is anybody there").unwrap();
        let e = c.read(&mut [0u8; 16]).expect_err("timed out");
        assert_eq!(e.raw_os_error(), Some(libc::ETIMEDOUT), "{e}");
    }
    ok(net.linux.ip(&["link", "set", &net.linux_if, "up"]), "the peer comes back");
    drop(client);

    // A client killed mid-transfer.
    let mut sink = net
        .linux
        .command("sh")
        .arg("-c")
        .arg("exec timeout 60 nc -l -p 6007 > /dev/null")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let mut sender = Command::new(lanbus_path())
        .args(["stack", "send", &format!("{LINUX_IP}:6007"), "--bytes", "100000000000", "--socket"])
        .arg(&net.socket)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    sender.kill().unwrap();
    sender.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = sink.try_wait().unwrap() {
            assert!(status.success(), "nc saw the connection end cleanly: {status}");
            break;
        }
        assert!(Instant::now() < deadline, "the peer of a killed client was left hanging");
        std::thread::sleep(Duration::from_millis(50));
    }
    net.settled("the killed client forgotten", |st| st["clients"] == 0);
    let client = net.client();
    let server = net.linux_server(6008, |l| {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut msg = Vec::new();
        s.read_to_end(&mut msg).unwrap();
        msg
    });
    let mut c = client.connect(SocketAddrV4::new(LINUX_IP, 6008)).unwrap();
    c.write_all(b"the next client works").unwrap();
    c.shutdown_write().unwrap();
    assert_eq!(server.join().unwrap(), b"the next client works");
    let _ = std::fs::remove_dir_all(&net.dir);
    drop(net.stackd);
}

/// The preload library as cargo built it (`scripts/test` builds it before the tests: a test
/// cannot build a library while cargo holds the build folder).
fn preload_library() -> PathBuf {
    Path::new(lanbus_path()).parent().unwrap().join("liblanbus_sock.so")
}

/// A command run with the preload library, attached to the test's stack server.
/// Whether a test of real programs through the preload library can run here: root, each of
/// `tools` installed (each lack said, and the test skipped), and the library built.
fn ready_for_programs(tools: &[&str]) -> bool {
    if let Err(skip) = check_root() {
        eprintln!("skipped: {}", skip.0);
        return false;
    }
    if let Some(tool) = tools.iter().find(|t| !have(t)) {
        eprintln!("skipped: {tool} is not installed (scripts/setup installs it)");
        return false;
    }
    assert!(
        preload_library().exists(),
        "{} is missing: build it first (`cargo build -p lanbus-sock`, as scripts/test does)",
        preload_library().display()
    );
    true
}

fn preloaded(net: &Net, program: &str) -> Command {
    // Bounded like everything in these tests: a stuck program fails the test, never hangs it.
    let mut c = Command::new("timeout");
    c.args(["120", program]);
    c.env("LD_PRELOAD", preload_library()).env("LANBUS_STACK_SOCKET", &net.socket);
    c
}

fn iperf3_bits(out: &str, what: &str) -> f64 {
    let v: serde_json::Value =
        serde_json::from_str(out).unwrap_or_else(|e| panic!("{what}: iperf3's JSON: {e}"));
    assert!(v["error"].is_null(), "{what}: {}", v["error"]);
    v["end"]["sum_received"]["bits_per_second"].as_f64().unwrap_or_else(|| panic!("{what}: no received rate"))
}

/// An asyncio echo server: `python3 -c ASYNCIO_ECHO IP PORT`.
const ASYNCIO_ECHO: &str = r#"
import asyncio, sys
async def serve(r, w):
    while line := await r.readline():
        w.write(line)
        await w.drain()
    w.close()
async def main():
    s = await asyncio.start_server(serve, sys.argv[1], int(sys.argv[2]))
    async with s:
        await s.serve_forever()
asyncio.run(main())
"#;

/// A selectors echo server with a non-blocking listener that accepts until EAGAIN.
const SELECTORS_ECHO: &str = r#"
import selectors, socket, sys
sel = selectors.DefaultSelector()
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind((sys.argv[1], int(sys.argv[2])))
l.listen(64)
l.setblocking(False)
sel.register(l, selectors.EVENT_READ)
while True:
    for key, _ in sel.select():
        if key.fileobj is l:
            while True:
                try:
                    c, _ = l.accept()
                except BlockingIOError:
                    break
                c.setblocking(False)
                sel.register(c, selectors.EVENT_READ)
        else:
            c = key.fileobj
            try:
                data = c.recv(4096)
            except BlockingIOError:
                continue
            if data:
                c.sendall(data)
            else:
                sel.unregister(c)
                c.close()
"#;

/// Eight connections opened at once, each sends a line and waits for it back: prints `8 answers`.
const ECHO_CLIENTS: &str = r#"
import socket, sys, time
addr = (sys.argv[1], int(sys.argv[2]))
deadline = time.time() + 20
while True:
    try:
        socket.create_connection(addr, timeout=5).close()
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(0.2)
conns = [socket.create_connection(addr, timeout=10) for _ in range(8)]
good = 0
for i, c in enumerate(conns):
    c.sendall(b"line %d\n" % i)
for i, c in enumerate(conns):
    got = b""
    while not got.endswith(b"\n"):
        more = c.recv(100)
        if not more:
            break
        got += more
    good += got == b"line %d\n" % i
    c.close()
print(good, "answers")
"#;

#[test]
fn unmodified_programs_through_the_preload_library() {
    if !ready_for_programs(&["nc", "iperf3", "curl", "python3", "sha256sum"]) {
        return;
    }
    let net = build('b');

    // iperf3's client through the library, 10 s each way, against iperf3 -s on Linux.
    for (dir, args) in [("to Linux", &[][..]), ("from Linux", &["-R"][..])] {
        let server = Daemon(
            net.linux
                .command("iperf3")
                .args(["-s", "-1", "-B", &LINUX_IP.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("iperf3 -s"),
        );
        std::thread::sleep(Duration::from_millis(400));
        let out = ok(
            preloaded(&net, "iperf3")
                .args(["-c", &LINUX_IP.to_string(), "-t", "10", "--json", "--connect-timeout", "5000"])
                .args(args)
                .output(),
            "iperf3 -c through the library",
        );
        let bits = iperf3_bits(&out, dir);
        eprintln!("iperf3 through the stack server, {dir}: {:.2} Gbit/s", bits / 1e9);
        assert!(bits > 1e6, "{dir}: {bits} bit/s");
        drop(server);
    }

    // iperf3's server through the library, Linux's client.
    let server = Daemon(
        preloaded(&net, "iperf3")
            .args(["-s", "-4", "-1", "-B", &STACK_IP.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("iperf3 -s through the library"),
    );
    std::thread::sleep(Duration::from_millis(800));
    let out = ok(
        net.linux
            .exec("iperf3", &["-c", &STACK_IP.to_string(), "-t", "2", "--json", "--connect-timeout", "5000"]),
        "iperf3 -c from Linux to the library's server",
    );
    assert!(iperf3_bits(&out, "to the library's iperf3 -s") > 1e6);
    drop(server);

    // curl through the library from python's http.server on Linux, and python's http.server
    // through the library to curl on Linux.
    let site = net.dir.join("site");
    std::fs::create_dir_all(&site).unwrap();
    let page: Vec<u8> = (0..2_000_000u32).map(|i| (i * 13 % 251) as u8).collect();
    std::fs::write(site.join("page.bin"), &page).unwrap();
    let linux_http = Daemon(
        net.linux
            .command("python3")
            .args(["-m", "http.server", "8000", "--bind", &LINUX_IP.to_string()])
            .current_dir(&site)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let stack_http = Daemon(
        preloaded(&net, "python3")
            .args(["-m", "http.server", "8001", "--bind", &STACK_IP.to_string()])
            .current_dir(&site)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    std::thread::sleep(Duration::from_millis(1500));
    let fetched = net.dir.join("fetched.bin");
    ok(
        preloaded(&net, "curl")
            .args(["-sS", "--retry", "3", "--retry-connrefused", "-o"])
            .arg(&fetched)
            .arg(format!("http://{LINUX_IP}:8000/page.bin"))
            .output(),
        "curl through the library",
    );
    assert!(std::fs::read(&fetched).unwrap() == page, "curl's copy of the page");
    let served = net.dir.join("served.bin");
    ok(
        net.linux
            .command("curl")
            .args(["-sS", "--retry", "3", "--retry-connrefused", "-o"])
            .arg(&served)
            .arg(format!("http://{STACK_IP}:8001/page.bin"))
            .output(),
        "curl on Linux from python's http.server through the library",
    );
    assert!(std::fs::read(&served).unwrap() == page, "the page the library's python served");
    drop(stack_http);
    drop(linux_http);

    // IPv6: iperf3's client through the library to Linux's iperf3 over IPv6, and python's
    // http.server through the library on `::` (both families, as Linux's dual-stack sockets)
    // fetched by curl on Linux over IPv6 and IPv4.
    let server = Daemon(
        net.linux
            .command("iperf3")
            .args(["-s", "-1", "-B", &LINUX_IP6.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("iperf3 -s"),
    );
    std::thread::sleep(Duration::from_millis(400));
    let out = ok(
        preloaded(&net, "iperf3")
            .args(["-c", &LINUX_IP6.to_string(), "-t", "2", "--json", "--connect-timeout", "5000"])
            .output(),
        "iperf3 -c over IPv6 through the library",
    );
    assert!(iperf3_bits(&out, "over IPv6") > 1e6);
    drop(server);
    let stack_http = Daemon(
        preloaded(&net, "python3")
            .args(["-m", "http.server", "8002", "--bind", "::"])
            .current_dir(&site)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    std::thread::sleep(Duration::from_millis(1500));
    for url in [format!("http://[{STACK_IP6}]:8002/page.bin"), format!("http://{STACK_IP}:8002/page.bin")] {
        let _ = std::fs::remove_file(&served);
        ok(
            net.linux
                .command("curl")
                .args(["-sS", "--retry", "3", "--retry-connrefused", "-o"])
                .arg(&served)
                .arg(&url)
                .output(),
            "curl on Linux from python's http.server on :: through the library",
        );
        assert!(std::fs::read(&served).unwrap() == page, "{url}");
    }
    drop(stack_http);

    // Event-loop servers through the library: python's asyncio (non-blocking accept and reads
    // through epoll) and a selectors loop that accepts several waiting connections in a row;
    // Linux's clients connect eight at a time and each gets its own line back.
    for (port, server) in [(8003u16, ASYNCIO_ECHO), (8004, SELECTORS_ECHO)] {
        let echo = Daemon(
            preloaded(&net, "python3")
                .args(["-c", server, &STACK_IP.to_string(), &port.to_string()])
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let out = ok(
            net.linux.exec("python3", &["-c", ECHO_CLIENTS, &STACK_IP.to_string(), &port.to_string()]),
            "Linux's clients of an event-loop server through the library",
        );
        assert_eq!(out.trim(), "8 answers", "port {port}");
        drop(echo);
    }

    // nc through the library: 50 MiB whose sha256 matches.
    let file = net.dir.join("50M.bin");
    ok(
        Command::new("sh")
            .arg("-c")
            .arg(format!("head -c 52428800 /dev/urandom > {}", file.display()))
            .output(),
        "random file",
    );
    let got = net.dir.join("nc.bin");
    let mut sink = net
        .linux
        .command("sh")
        .arg("-c")
        .arg(format!("exec timeout 60 nc -l -p 6101 > {}", got.display()))
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    ok(
        preloaded(&net, "nc")
            .args(["-N", &LINUX_IP.to_string(), "6101"])
            .stdin(std::fs::File::open(&file).unwrap())
            .output(),
        "nc through the library",
    );
    assert!(sink.wait().unwrap().success());
    assert_eq!(sha256(&got), sha256(&file));

    // The stack server dies under a program in mid-transfer: the program gets an error, not a hang.
    // (nc itself, not under `timeout`, so that killing the child ends it.)
    let mut sink = net
        .linux
        .command("sh")
        .arg("-c")
        .arg("exec nc -l -p 6102 > /dev/null")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let mut writer = preloaded(&net, "sh")
        .arg("-c")
        .arg(format!("head -c 100000000000 /dev/zero | nc -N {LINUX_IP} 6102"))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    drop(net.stackd);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        // nc ends however it reports a failed write; what matters is that it ends.
        if writer.try_wait().unwrap().is_some() {
            break;
        }
        assert!(Instant::now() < deadline, "a program was left hanging when the stack server died");
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = sink.kill();
    let _ = sink.wait();
    let _ = std::fs::remove_dir_all(&net.dir);
}

/// Connects, forks; the parent closes its copy, then the child writes, reads the answer and
/// closes. `python3 -c FORKED_CONNECTION IP PORT`; prints `child done` and `parent done`.
const FORKED_CONNECTION: &str = r#"
import os, socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.read(r, 1)
    s.sendall(b"from the child\n")
    got = b""
    while not got.endswith(b"\n"):
        more = s.recv(100)
        if not more:
            break
        got += more
    assert got == b"answer\n", got
    s.close()
    print("child done", flush=True)
    os._exit(0)
s.close()
os.write(w, b"x")
_, status = os.waitpid(pid, 0)
assert status == 0, status
print("parent done", flush=True)
"#;

/// Connects, forks; the child execs `sleep 20` without touching the socket, the parent closes
/// its copy, says `closed`, and ends the child when told (a line on stdin).
/// `python3 -c FORK_THEN_EXEC IP PORT`.
const FORK_THEN_EXEC: &str = r#"
import os, signal, socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
pid = os.fork()
if pid == 0:
    os.execv("/bin/sleep", ["sleep", "20"])
s.close()
print("closed", flush=True)
sys.stdin.readline()
os.kill(pid, signal.SIGKILL)
os.waitpid(pid, 0)
print("parent done", flush=True)
"#;

/// A pre-fork server: one listener, two forked workers accepting on it, the parent closing its
/// copy. Each worker answers a line with its number and the line, and stops at `quit`.
/// `python3 -c PREFORK_SERVER IP PORT`; prints `listening`, then each worker's count served.
const PREFORK_SERVER: &str = r#"
import os, socket, sys
l = socket.socket()
l.bind((sys.argv[1], int(sys.argv[2])))
l.listen(64)
print("listening", flush=True)
kids = []
for worker in range(2):
    pid = os.fork()
    if pid == 0:
        served = 0
        while True:
            c, _ = l.accept()
            c.settimeout(20)
            line = b""
            while not line.endswith(b"\n"):
                more = c.recv(100)
                if not more:
                    break
                line += more
            if line == b"quit\n":
                c.sendall(b"bye\n")
                c.close()
                break
            c.sendall(b"%d %s" % (worker, line))
            c.close()
            served += 1
        print("worker", worker, "served", served, flush=True)
        os._exit(0)
    kids.append(pid)
l.close()
for pid in kids:
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
print("workers done", flush=True)
"#;

/// One line to `addr` from the Linux namespace's thread, and everything the other end answers
/// until it closes.
fn ask(addr: SocketAddrV4, line: &[u8]) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut c = loop {
        match std::net::TcpStream::connect_timeout(&addr.into(), Duration::from_secs(5)) {
            Ok(c) => break c,
            Err(e) => assert!(Instant::now() < deadline, "connecting to {addr}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(line).unwrap();
    let mut got = Vec::new();
    c.read_to_end(&mut got).unwrap_or_else(|e| panic!("reading {addr}'s answer: {e}"));
    got
}

#[test]
fn forked_children_keep_their_parents_sockets() {
    if !ready_for_programs(&["python3"]) {
        return;
    }
    let net = build('f');

    // A connection through a fork: the parent's close sends no FIN, the child's does.
    let linux = net.linux_server(6201, |l| {
        let (mut c, _) = l.accept().expect("the forked program's connection");
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while !line.ends_with(b"\n") {
            // The parent closed its copy before the child wrote: had that ended the
            // connection, this read would see the end (or a reset) before the child's line.
            let n = c.read(&mut byte).expect("the child's line");
            assert_eq!(n, 1, "the connection ended before the child wrote: {:?}", line);
            line.push(byte[0]);
        }
        assert_eq!(line, b"from the child\n");
        c.write_all(b"answer\n").unwrap();
        let mut rest = Vec::new();
        // The child's close ends it: FIN, and nothing more.
        c.read_to_end(&mut rest).expect("the end after the child's close");
        assert!(rest.is_empty(), "{rest:?}");
    });
    let out = ok(
        preloaded(&net, "python3").args(["-c", FORKED_CONNECTION, &LINUX_IP.to_string(), "6201"]).output(),
        "python forking with a connection through the library",
    );
    assert!(out.contains("child done") && out.contains("parent done"), "{out}");
    linux.join().expect("the Linux side of the forked connection");

    // A child that execs lets go of what it inherited at the exec: the parent's close ends the
    // connection while the exec'd child still runs.
    let linux = net.linux_server(6203, |l| {
        let (mut c, _) = l.accept().expect("the forked program's connection");
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).expect("the end, while the exec'd child runs");
        assert!(rest.is_empty(), "{rest:?}");
    });
    let mut forked = Daemon(
        preloaded(&net, "python3")
            .args(["-c", FORK_THEN_EXEC, &LINUX_IP.to_string(), "6203"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python forking and execing through the library"),
    );
    linux.join().expect("the Linux side of the exec'd child's connection");
    // Only now does the child end (the parent kills it when told).
    forked.0.stdin.take().unwrap().write_all(b"\n").unwrap();
    let mut said = String::new();
    forked.0.stdout.take().unwrap().read_to_string(&mut said).unwrap();
    assert!(forked.0.wait().unwrap().success() && said.contains("parent done"), "{said}");

    // A pre-fork server: two workers accept on the listener they inherited, each client is
    // served once, by one of them.
    let mut server = Daemon(
        preloaded(&net, "python3")
            .args(["-c", PREFORK_SERVER, &STACK_IP.to_string(), "6202"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("the pre-fork server through the library"),
    );
    let mut stdout = std::io::BufReader::new(server.0.stdout.take().unwrap());
    let mut first = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut first).unwrap();
    assert_eq!(first.trim(), "listening");
    const CLIENTS: usize = 40;
    let name = net.linux.name().to_string();
    let answers = std::thread::spawn(move || {
        lanbus_port::netns::enter(&name).expect("entering the namespace");
        let addr = SocketAddrV4::new(STACK_IP, 6202);
        // Eight at a time, so that both workers are busy at once.
        let mut answers = Vec::new();
        for batch in 0..CLIENTS / 8 {
            let threads: Vec<_> = (0..8)
                .map(|i| {
                    let line = format!("client {}\n", batch * 8 + i);
                    std::thread::spawn(move || (line.clone(), ask(addr, line.as_bytes())))
                })
                .collect();
            answers.extend(threads.into_iter().map(|t| t.join().expect("a client")));
        }
        let byes = [ask(addr, b"quit\n"), ask(addr, b"quit\n")];
        (answers, byes)
    })
    .join()
    .expect("the Linux clients");
    let (answers, byes) = answers;
    let mut per_worker = [0usize; 2];
    for (line, got) in &answers {
        let got = String::from_utf8_lossy(got);
        let (worker, echoed) = got.split_once(' ').unwrap_or_else(|| panic!("{line:?} got {got:?}"));
        assert_eq!(echoed, line, "each client is answered once, with its own line");
        per_worker[worker.parse::<usize>().expect("a worker's number")] += 1;
    }
    assert_eq!(answers.len(), CLIENTS);
    assert_eq!(byes, [b"bye\n".to_vec(), b"bye\n".to_vec()], "each worker stops once");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    assert!(server.0.wait().unwrap().success(), "{rest}");
    assert!(rest.contains("workers done"), "{rest}");
    let served: usize = rest
        .lines()
        .filter_map(|l| l.strip_prefix("worker ")?.split_once(" served ")?.1.parse::<usize>().ok())
        .sum();
    assert_eq!(served, CLIENTS, "the workers' own counts: {rest}");
    eprintln!("pre-fork server: clients served per worker {per_worker:?}");

    // Nothing is left: every socket closed when its last holder did.
    net.settled("every socket freed", |st| {
        st["listening"].as_array().is_some_and(|l| l.is_empty())
            && st["connections"].as_array().is_some_and(|c| c.is_empty())
            && st["clients"] == 0
            && st["counters"]["forks_adopted"].as_u64() >= Some(3)
            && st["counters"]["forks_refused"] == 0
    });
    drop(net.stackd);
    let _ = std::fs::remove_dir_all(&net.dir);
}

/// A non-blocking writer: sends `TOTAL` bytes, waiting in epoll (`level` or `edge`-triggered)
/// for `EPOLLOUT` after each `EAGAIN`; then a blocking `sendall` and `sendfile` on a second
/// thread while the main thread reads. `python3 -c NONBLOCKING_WRITER IP PORT MODE TOTAL`; prints the stream's
/// sha256, the `EAGAIN`s and the wake-ups, and what the reading thread got.
const NONBLOCKING_WRITER: &str = r#"
import hashlib, select, socket, sys, tempfile, threading
ip, port, mode, total = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
s = socket.create_connection((ip, port), timeout=20)
s.setblocking(False)
ep = select.epoll()
ep.register(s.fileno(), select.EPOLLOUT | (select.EPOLLET if mode == "edge" else 0))
h = hashlib.sha256()
sent = eagain = wakeups = chunk = 0
buf = b""
while sent < total:
    if not buf:
        buf = (hashlib.sha256(b"%d" % chunk).digest() * 2048)[: total - sent]
        chunk += 1
    try:
        n = s.send(buf)
    except BlockingIOError:
        eagain += 1
        events = ep.poll(20)
        assert events and events[0][1] & select.EPOLLOUT, "no EPOLLOUT within 20 s"
        wakeups += 1
        continue
    h.update(buf[:n])
    sent += n
    buf = buf[n:]
# A blocking writer on another thread must not keep this one from reading the same socket:
# 8 MiB of zeros by sendall, then 8 MiB of ones from a file by sendfile.
s.setblocking(True)
s.settimeout(20)
def blocking_writer():
    s.sendall(b"\0" * (8 << 20))
    with tempfile.TemporaryFile() as f:
        f.write(b"\1" * (8 << 20))
        f.flush()
        f.seek(0)
        assert s.sendfile(f) == 8 << 20
t = threading.Thread(target=blocking_writer)
t.start()
line = b""
while not line.endswith(b"\n"):
    line += s.recv(100)
t.join(30)
assert not t.is_alive(), "the blocking sendall did not end"
s.shutdown(socket.SHUT_WR)
print(h.hexdigest(), eagain, wakeups, line.decode().strip(), flush=True)
"#;

#[test]
fn nonblocking_writes_get_eagain_and_epollout_when_room_returns() {
    if !ready_for_programs(&["python3", "sha256sum"]) {
        return;
    }
    let net = build('w');
    const TOTAL: usize = 64 << 20;
    for (mode, port) in [("level", 6301u16), ("edge", 6302)] {
        let got = net.dir.join(format!("{mode}.bin"));
        let file = got.clone();
        let linux = net.linux_server(port, move |l| {
            let (mut c, _) = l.accept().expect("the writer's connection");
            c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            // Not reading at first: the writer runs out of room.
            std::thread::sleep(Duration::from_millis(1500));
            let mut stream = vec![0u8; TOTAL];
            c.read_exact(&mut stream).expect("the non-blocking writer's bytes");
            std::fs::write(&file, &stream).unwrap();
            // The second phase: a line for the reading thread while the blocking writer waits
            // for room (this side reads nothing for a while), then its bytes and the end.
            c.write_all(b"while it writes\n").unwrap();
            std::thread::sleep(Duration::from_millis(1000));
            let mut rest = Vec::new();
            c.read_to_end(&mut rest).expect("the blocking writer's bytes");
            assert_eq!(rest.len(), 16 << 20, "the blocking sendall's and sendfile's bytes, exactly");
            assert!(rest[..8 << 20].iter().all(|&b| b == 0) && rest[8 << 20..].iter().all(|&b| b == 1));
        });
        let out = ok(
            preloaded(&net, "python3")
                .args(["-c", NONBLOCKING_WRITER, &LINUX_IP.to_string(), &port.to_string(), mode])
                .arg(TOTAL.to_string())
                .output(),
            "python's non-blocking writer through the library",
        );
        linux.join().expect("the Linux reader");
        let fields: Vec<&str> = out.split_whitespace().collect();
        let [digest, eagain, wakeups, ..] = fields[..] else { panic!("{mode}: {out}") };
        assert_eq!(digest, sha256(&got), "{mode}: every byte once, in order");
        let (eagain, wakeups): (u64, u64) = (eagain.parse().unwrap(), wakeups.parse().unwrap());
        assert!(eagain >= 1, "{mode}: the writer never ran out of room: {out}");
        assert_eq!(wakeups, eagain, "{mode}: each EAGAIN ended with EPOLLOUT: {out}");
        assert!(out.contains("while it writes"), "{mode}: the reader beside a blocked writer: {out}");
        eprintln!("{mode}-triggered writer: {eagain} EAGAIN, each ended by EPOLLOUT");
    }
    drop(net.stackd);
    let _ = std::fs::remove_dir_all(&net.dir);
}

/// An nginx configuration of its own under `dir`: a master and two workers (forked after the
/// master opened the listener), serving `site` on `listen`, with every path in `dir`. The
/// workers stay root: each attaches to the stack server anew, whose socket is root's.
fn nginx_config(dir: &Path, listen: &str, site: &Path) -> PathBuf {
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
    let d = dir.display();
    let conf = format!(
        "daemon off;\nmaster_process on;\nworker_processes 2;\nuser root;\npid {d}/nginx.pid;\n\
         error_log {d}/error.log notice;\nevents {{ worker_connections 4096; }}\nhttp {{\n\
         access_log off;\nclient_body_temp_path {d}/tmp/body;\nproxy_temp_path {d}/tmp/proxy;\n\
         fastcgi_temp_path {d}/tmp/fastcgi;\nuwsgi_temp_path {d}/tmp/uwsgi;\nscgi_temp_path {d}/tmp/scgi;\n\
         sendfile on;\ntcp_nopush on;\ntcp_nodelay on;\nkeepalive_requests 1000000;\n\
         server {{ listen {listen}; root {}; }}\n}}\n",
        site.display()
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).unwrap();
    path
}

/// nginx with `config`: through the preload library when `net` is given, else in the Linux
/// namespace. Returns once it answers `url` (curl from the other side retries until then).
fn start_nginx(net: &Net, config: &Path, through_stack: bool, url: &str) -> Daemon {
    let prefix = config.parent().unwrap();
    let mut c = if through_stack {
        let mut c = Command::new("nginx");
        c.env("LD_PRELOAD", preload_library()).env("LANBUS_STACK_SOCKET", &net.socket);
        c
    } else {
        net.linux.command("nginx")
    };
    let nginx = Daemon(
        c.arg("-p")
            .arg(prefix)
            .arg("-c")
            .arg(config)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting nginx"),
    );
    let mut curl = if through_stack { net.linux.command("curl") } else { preloaded(net, "curl") };
    ok(
        curl.args(["-sS", "-o", "/dev/null", "--retry", "50", "--retry-connrefused", "--retry-delay", "0"])
            .args(["--retry-max-time", "20", "--max-time", "20", url])
            .output(),
        "nginx answers",
    );
    nginx
}

/// Waits (at most 20 s) until a download into `path` has its first MiB.
fn wait_for_first_mebibyte(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::metadata(path).map_or(0, |m| m.len()) < 1 << 20 {
        assert!(Instant::now() < deadline, "the download did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The worker processes of nginx's master `pid`.
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Runs `wrk` (through the library or in the Linux namespace) for 3 s with 64 connections;
/// `close`: one request per connection. Returns the requests done and wrk's report, after
/// checking that it saw no socket error and no response other than 2xx/3xx.
fn wrk(net: &Net, through_stack: bool, url: &str, close: bool, errors_allowed: bool) -> (u64, String) {
    let mut c = if through_stack { preloaded(net, "wrk") } else { net.linux.command("wrk") };
    c.args(["-t", "2", "-c", "64", "-d", "3s", "--timeout", "5s", "--latency"]);
    if close {
        c.args(["-H", "Connection: close"]);
    }
    let out = ok(c.arg(url).output(), "wrk");
    if !errors_allowed {
        assert!(!out.contains("Socket errors") && !out.contains("Non-2xx"), "wrk {url}: {out}");
    }
    let requests = out
        .lines()
        .find_map(|l| l.trim().split_once(" requests in ").and_then(|(n, _)| n.parse().ok()))
        .unwrap_or_else(|| panic!("wrk's report: {out}"));
    (requests, out)
}

/// Fetches `url` with curl (through the library or in the Linux namespace) and checks its
/// sha256 against `want`.
fn fetch_checked(net: &Net, through_stack: bool, url: &str, to: &Path, want: &str) {
    let _ = std::fs::remove_file(to);
    let mut c = if through_stack { preloaded(net, "curl") } else { net.linux.command("curl") };
    ok(c.args(["-sS", "--max-time", "60", "-o"]).arg(to).arg(url).output(), "curl");
    assert_eq!(sha256(to), want, "{url}: every byte, once, in order");
    std::fs::remove_file(to).unwrap();
}

/// `python3 -c OPEN_AND_DROP IP PORT N`: N connections, 32 at a time, each dropped in one of
/// four ways: closed at once, closed after half a request, closed with a reset, or closed after
/// a whole request without reading the answer. Prints how many connected.
const OPEN_AND_DROP: &str = r#"
import socket, struct, sys, threading
ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
done = [0] * 32
def run(k):
    for i in range(k, n, 32):
        s = socket.create_connection((ip, port), timeout=20)
        way = i % 4
        if way == 1:
            s.sendall(b"GET /index.html HTTP/1.1\r\nHo")
        elif way == 2:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif way == 3:
            s.sendall(b"GET /index.html HTTP/1.1\r\nHost: x\r\n\r\n")
        s.close()
        done[k] += 1
ts = [threading.Thread(target=run, args=(k,)) for k in range(32)]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(sum(done), "connected")
"#;

/// `python3 -c HALF_REQUESTS IP PORT`: 16 connections each with half a request, then `ready`;
/// it waits to be killed.
const HALF_REQUESTS: &str = r#"
import socket, sys, time
conns = [socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20) for _ in range(16)]
for c in conns:
    c.sendall(b"GET /big.bin HTTP/1.1\r\nHost: x\r\n")
print("ready", flush=True)
time.sleep(60)
"#;

#[test]
fn nginx_through_the_preload_library_and_against_it() {
    if !ready_for_programs(&["nginx", "wrk", "curl", "python3", "sha256sum"]) {
        return;
    }
    let net = build('n');
    let site = net.dir.join("site");
    std::fs::create_dir_all(&site).unwrap();
    std::fs::write(site.join("index.html"), "<p>a small page</p>\n".repeat(10)).unwrap();
    let big = site.join("big.bin");
    ok(
        Command::new("sh")
            .arg("-c")
            .arg(format!("head -c 104857600 /dev/urandom > {}", big.display()))
            .output(),
        "random file",
    );
    let want = sha256(&big);
    let fetched = net.dir.join("fetched.bin");

    // nginx through the library, wrk and curl on Linux.
    let config = nginx_config(&net.dir.join("stack-nginx"), &format!("{STACK_IP}:8080"), &site);
    let page = format!("http://{STACK_IP}:8080/index.html");
    let mut nginx = start_nginx(&net, &config, true, &page);
    let master = nginx.0.id();
    assert_eq!(children(master).len(), 2, "two workers");
    let (keep_alive, _) = wrk(&net, false, &page, false, false);
    let (one_each, _) = wrk(&net, false, &page, true, false);
    eprintln!("nginx through the stack server: {keep_alive} requests kept alive, {one_each} one per connection in 3 s");
    assert!(keep_alive > 0 && one_each > 0);
    fetch_checked(&net, false, &format!("http://{STACK_IP}:8080/big.bin"), &fetched, &want);

    // A slow download beside wrk: the worker's non-blocking writes to it run out of room (a
    // short count or EAGAIN) and go on when EPOLLOUT says room returned, so the download keeps
    // moving and the worker's event loop keeps serving the small page at half its rate or more.
    let slow = net.dir.join("slow.bin");
    let mut download = net
        .linux
        .command("curl")
        .args(["-sS", "--limit-rate", "2M", "-o"])
        .arg(&slow)
        .arg(format!("http://{STACK_IP}:8080/big.bin"))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_first_mebibyte(&slow);
    let slow_before = std::fs::metadata(&slow).unwrap().len();
    let (beside_slow, _) = wrk(&net, false, &page, false, false);
    let slow_after = std::fs::metadata(&slow).unwrap().len();
    assert!(download.try_wait().unwrap().is_none(), "the 2 MiB/s download of 100 MiB ended early");
    download.kill().unwrap();
    download.wait().unwrap();
    eprintln!(
        "beside a 2 MiB/s download: {beside_slow} requests kept alive in 3 s (alone {keep_alive}); the download moved {} KiB",
        (slow_after - slow_before) >> 10
    );
    assert!(2 * beside_slow >= keep_alive, "wrk beside a slow download: {beside_slow}, alone {keep_alive}");
    assert!(slow_after >= slow_before + (1 << 20), "the slow download stalled while wrk ran");

    // 10,000 connections opened and dropped (at once, half-way through a request, by a reset,
    // without reading the answer).
    let out = ok(
        net.linux.exec("python3", &["-c", OPEN_AND_DROP, &STACK_IP.to_string(), "8080", "10000"]),
        "10,000 connections opened and dropped",
    );
    assert_eq!(out.trim(), "10000 connected");

    // Clients killed mid-request: half-sent requests, and a download.
    let mut half = net
        .linux
        .command("python3")
        .args(["-c", HALF_REQUESTS, &STACK_IP.to_string(), "8080"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(half.stdout.take().unwrap()), &mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    half.kill().unwrap();
    half.wait().unwrap();
    let partial = net.dir.join("partial.bin");
    let mut download = net
        .linux
        .command("curl")
        .args(["-sS", "--limit-rate", "20M", "-o"])
        .arg(&partial)
        .arg(format!("http://{STACK_IP}:8080/big.bin"))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_first_mebibyte(&partial);
    download.kill().unwrap();
    download.wait().unwrap();

    // A worker killed while wrk runs: the master starts another, and everything works after.
    let name = net.linux.name().to_string();
    let url = page.clone();
    let during = std::thread::spawn(move || {
        let out = Command::new("ip")
            .args(["netns", "exec", &name, "wrk", "-t", "2", "-c", "64", "-d", "3s", "--timeout", "5s", &url])
            .output()
            .expect("wrk");
        String::from_utf8_lossy(&out.stdout).into_owned()
    });
    std::thread::sleep(Duration::from_millis(1000));
    let victim = children(master)[0];
    // SAFETY: kill(2) on a process of the test's own nginx.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    let out = during.join().unwrap();
    assert!(out.contains(" requests in "), "{out}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let workers = children(master);
        if workers.len() == 2 && !workers.contains(&victim) {
            break;
        }
        assert!(Instant::now() < deadline, "nginx did not replace its killed worker: {workers:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (after, _) = wrk(&net, false, &page, false, false);
    assert!(after > 0);
    fetch_checked(&net, false, &format!("http://{STACK_IP}:8080/big.bin"), &fetched, &want);
    assert!(nginx.0.try_wait().unwrap().is_none(), "nginx's master ended");
    drop(nginx);

    // Nothing is left of any of it.
    net.settled("nginx's connections and listener freed", |st| {
        st["listening"].as_array().is_some_and(|l| l.is_empty())
            && st["connections"].as_array().is_some_and(|c| c.is_empty())
            && st["clients"] == 0
            && st["counters"]["connections_opened"] == st["counters"]["connections_freed"]
    });

    // nginx on Linux, wrk and curl through the library; a download through the library killed
    // mid-transfer.
    let config = nginx_config(&net.dir.join("linux-nginx"), &format!("{LINUX_IP}:8090"), &site);
    let page = format!("http://{LINUX_IP}:8090/index.html");
    let nginx = start_nginx(&net, &config, false, &page);
    let (keep_alive, _) = wrk(&net, true, &page, false, false);
    let (one_each, _) = wrk(&net, true, &page, true, false);
    eprintln!("wrk through the stack server: {keep_alive} requests kept alive, {one_each} one per connection in 3 s");
    assert!(keep_alive > 0 && one_each > 0);
    fetch_checked(&net, true, &format!("http://{LINUX_IP}:8090/big.bin"), &fetched, &want);
    let mut download = preloaded(&net, "curl")
        .args(["-sS", "--limit-rate", "20M", "-o"])
        .arg(&partial)
        .arg(format!("http://{LINUX_IP}:8090/big.bin"))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_first_mebibyte(&partial);
    // `timeout`'s child: kill curl itself.
    for pid in children(download.id()) {
        // SAFETY: kill(2) on the test's own curl.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    download.wait().unwrap();
    net.settled("the killed download's connection freed", |st| {
        st["connections"].as_array().is_some_and(|c| c.is_empty()) && st["clients"] == 0
    });
    drop(nginx);
    drop(net.stackd);
    let _ = std::fs::remove_dir_all(&net.dir);
}

/// `python3 -c MEMCACHED_VALUES IP PORT`: stores 200 values of up to 100 KiB in memcached
/// (waiting up to 20 s for it to answer), reads each back and compares; prints `200 values`.
const MEMCACHED_VALUES: &str = r#"
import hashlib, socket, sys, time
addr = (sys.argv[1], int(sys.argv[2]))
deadline = time.time() + 20
while True:
    try:
        s = socket.create_connection(addr, timeout=20)
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(0.1)
f = s.makefile("rb")
def value(i):
    return (hashlib.sha256(b"%d" % i).digest() * 3200)[: (i * 997) % 102400 + 1]
for i in range(200):
    v = value(i)
    s.sendall(b"set key%d 0 0 %d\r\n%s\r\n" % (i, len(v), v))
    assert f.readline() == b"STORED\r\n"
good = 0
for i in range(200):
    s.sendall(b"get key%d\r\n" % i)
    head = f.readline().split()
    assert head[:2] == [b"VALUE", b"key%d" % i], head
    got = f.read(int(head[3]) + 2)[:-2]
    assert f.readline() == b"END\r\n"
    good += got == value(i)
print(good, "values")
"#;

/// `python3 -c ASYNCIO_CLIENTS IP PORT`: 50 asyncio connections at once, each sending 20 lines
/// and reading each back (waiting up to 20 s for the server); prints `50 clients`.
const ASYNCIO_CLIENTS: &str = r#"
import asyncio, sys, time
async def one(i):
    r, w = await asyncio.open_connection(sys.argv[1], int(sys.argv[2]))
    for k in range(20):
        line = b"client %d line %d\n" % (i, k)
        w.write(line)
        await w.drain()
        if await r.readline() != line:
            return 0
    w.close()
    await w.wait_closed()
    return 1
async def main():
    deadline = time.time() + 20
    while True:
        try:
            _, w = await asyncio.open_connection(sys.argv[1], int(sys.argv[2]))
            w.close()
            break
        except OSError:
            if time.time() > deadline:
                raise
            await asyncio.sleep(0.1)
    done = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(50))), 60)
    print(sum(done), "clients")
asyncio.run(main())
"#;

/// memcslap's `-t test` against `server` (through the library or in the Linux namespace):
/// checks that it reports the test done and no failure.
fn memcslap(net: &Net, through_stack: bool, server: &str, test: &str) {
    let mut c = if through_stack { preloaded(net, "memcslap") } else { net.linux.command("memcslap") };
    let out = c.args(["-s", server, "-c", "8", "-e", "2000", "-t", test]).output().expect("memcslap");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "memcslap -t {test}: {said}");
    assert!(
        said.contains(&format!("Time to {test} ")) && !said.contains("error") && !said.contains("FAILURE"),
        "memcslap -t {test} against {server}: {said}"
    );
}

#[test]
fn event_loop_servers_through_the_preload_library_and_against_them() {
    if !ready_for_programs(&["memcached", "memcslap", "python3"]) {
        return;
    }
    let net = build('e');
    let (stack, linux) = (STACK_IP.to_string(), LINUX_IP.to_string());

    // memcached (libevent, four threads) through the library, memcslap and a checking client on
    // Linux; then memcached on Linux, memcslap and the checking client through the library.
    let memcached = Daemon(
        preloaded(&net, "memcached")
            .args(["-u", "root", "-t", "4", "-U", "0", "-l", &stack, "-p", "11211"])
            .spawn()
            .expect("memcached through the library"),
    );
    let out = ok(net.linux.exec("python3", &["-c", MEMCACHED_VALUES, &stack, "11211"]), "memcached's values");
    assert_eq!(out.trim(), "200 values");
    for test in ["set", "get", "mget"] {
        memcslap(&net, false, &format!("{stack}:11211"), test);
    }
    drop(memcached);
    let memcached = Daemon(
        net.linux
            .command("memcached")
            .args(["-u", "root", "-t", "4", "-U", "0", "-l", &linux, "-p", "11212"])
            .spawn()
            .expect("memcached on Linux"),
    );
    let out = ok(
        preloaded(&net, "python3").args(["-c", MEMCACHED_VALUES, &linux, "11212"]).output(),
        "memcached's values through the library",
    );
    assert_eq!(out.trim(), "200 values");
    for test in ["set", "get", "mget"] {
        memcslap(&net, true, &format!("{linux}:11212"), test);
    }
    drop(memcached);

    // python's asyncio: clients through the library to a server on Linux, and the other way.
    let server = Daemon(
        net.linux
            .command("python3")
            .args(["-c", ASYNCIO_ECHO, &linux, "8005"])
            .spawn()
            .expect("asyncio server on Linux"),
    );
    let out = ok(
        preloaded(&net, "python3").args(["-c", ASYNCIO_CLIENTS, &linux, "8005"]).output(),
        "asyncio clients through the library",
    );
    assert_eq!(out.trim(), "50 clients");
    drop(server);
    let server = Daemon(
        preloaded(&net, "python3")
            .args(["-c", ASYNCIO_ECHO, &stack, "8006"])
            .spawn()
            .expect("asyncio server through the library"),
    );
    let out =
        ok(net.linux.exec("python3", &["-c", ASYNCIO_CLIENTS, &stack, "8006"]), "asyncio clients on Linux");
    assert_eq!(out.trim(), "50 clients");
    drop(server);

    // Options the stack lacks fail, each named once on stderr; a v6-only socket is refused.
    let out = preloaded(&net, "python3").args(["-c", REFUSED_OPTIONS]).output().expect("python3");
    let (said, errors) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(said.trim(), "EOPNOTSUPP EOPNOTSUPP ENOPROTOOPT taken", "{errors}");
    let lines: Vec<&str> = errors.lines().filter(|l| l.starts_with("liblanbus_sock:")).collect();
    assert_eq!(lines.len(), 2, "one line per option: {errors}");
    assert!(lines[0].contains("IPV6_V6ONLY") && lines[1].contains("option 23 at IPPROTO_TCP"), "{errors}");

    net.settled("every socket freed", |st| {
        st["listening"].as_array().is_some_and(|l| l.is_empty())
            && st["connections"].as_array().is_some_and(|c| c.is_empty())
            && st["clients"] == 0
            && st["counters"]["connections_opened"] == st["counters"]["connections_freed"]
    });
    drop(net.stackd);
    let _ = std::fs::remove_dir_all(&net.dir);
}

/// Sets `IPV6_V6ONLY` twice and `TCP_FASTOPEN` (23) once, then `IPV6_V6ONLY` to 0 on a lanbus
/// socket; prints each errno's name (`taken` when it succeeds).
const REFUSED_OPTIONS: &str = r#"
import errno, socket
s = socket.socket(socket.AF_INET6)
said = []
for level, name, value in [
    (socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1),
    (socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1),
    (socket.IPPROTO_TCP, 23, 5),
    (socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0),
]:
    try:
        s.setsockopt(level, name, value)
        said.append("taken")
    except OSError as e:
        said.append("EOPNOTSUPP" if e.errno == errno.EOPNOTSUPP else errno.errorcode[e.errno])
print(*said)
"#;
