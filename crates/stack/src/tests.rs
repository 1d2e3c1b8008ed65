//! Two stack servers joined by a simulated wire (no root needed): TCP both ways over a lossy
//! link, refusals and resets, UDP, many connections, and clients that die or misbehave.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use lanbus_port::sim::{SimWire, SimWireConfig};
use lanbus_wire::{MacAddr, MonotonicClock};

use crate::client::StackClient;
use crate::proto::Msg;
use crate::server::{Server, ServerConfig};
use crate::{hello, Channel, CopyUnit};

const A: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const A6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 1);
const B6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 2);

struct Pair {
    a: Server,
    b: Server,
    sock_a: PathBuf,
    sock_b: PathBuf,
    _dir: PathBuf,
}

fn pair(name: &str, loss: f64) -> Pair {
    let dir = std::env::temp_dir().join(format!("lanbus-stack-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let wire = SimWireConfig { loss, seed: 7, delay: Duration::from_micros(20), ..SimWireConfig::default() };
    let macs = [MacAddr([2, 0, 0, 0, 0, 1]), MacAddr([2, 0, 0, 0, 0, 2])];
    let (pa, pb) = SimWire::pair_realtime(wire, Arc::new(MonotonicClock::new()), macs).unwrap();
    let (sock_a, sock_b) = (dir.join("a.sock"), dir.join("b.sock"));
    let mut ca = ServerConfig::new(A, 24, &sock_a);
    let mut cb = ServerConfig::new(B, 24, &sock_b);
    ca.timeout = Duration::from_secs(3);
    cb.timeout = Duration::from_secs(3);
    ca.ip6 = Some((A6, 64));
    cb.ip6 = Some((B6, 64));
    let a = Server::start(Box::new(pa), ca).unwrap();
    let b = Server::start(Box::new(pb), cb).unwrap();
    Pair { a, b, sock_a, sock_b, _dir: dir }
}

/// Runs `f` on a thread and fails the test if it takes longer than `secs`: no test hangs.
fn bounded(secs: u64, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => t.join().unwrap(),
        Err(_) if t.is_finished() => std::panic::resume_unwind(t.join().unwrap_err()),
        Err(_) => panic!("did not finish within {secs} s"),
    }
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 11) as u8).collect()
}

/// Compares without printing megabytes: the lengths and the first byte that differs.
fn assert_same(got: &[u8], want: &[u8], what: &str) {
    if got != want {
        let first = got.iter().zip(want).position(|(a, b)| a != b);
        panic!("{what}: {} bytes where {} were sent, first difference at {first:?}", got.len(), want.len());
    }
}

fn read_all(s: &mut impl Read) -> Vec<u8> {
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    out
}

fn exchange(unit: CopyUnit, loss: f64, name: &str) {
    let p = pair(name, loss);
    let (ca, cb) =
        (StackClient::attach(&p.sock_a, unit).unwrap(), StackClient::attach(&p.sock_b, unit).unwrap());
    assert_eq!(ca.local_ip(), (A, 24));
    let listener = cb.listen(7000, 4).unwrap();
    let up = pattern(3 << 20, 1);
    let down = pattern(1 << 20, 2);
    let (up2, down2) = (up.clone(), down.clone());
    let server = std::thread::spawn(move || {
        let (mut s, peer) = listener.accept().unwrap();
        assert_eq!(peer.ip(), IpAddr::V4(A));
        assert_same(&read_all(&mut s), &up2, "the bytes A sent");
        s.write_all(&down2).unwrap();
    });
    let mut s = ca.connect(SocketAddrV4::new(B, 7000)).unwrap();
    assert_eq!(s.local_addr().ip(), IpAddr::V4(A));
    s.write_all(&up).unwrap();
    s.shutdown_write().unwrap();
    assert_same(&read_all(&mut s), &down, "the bytes B sent back");
    server.join().unwrap();
    drop(s);
    drop(p.b);
    drop(p.a);
}

#[test]
fn tcp_both_ways_over_shared_memory_on_a_lossy_wire() {
    bounded(120, || exchange(CopyUnit::DEFAULT, 0.005, "shm"));
}

#[test]
fn tcp_both_ways_with_the_baseline_copy_path() {
    bounded(120, || exchange(CopyUnit::BASELINE, 0.0, "baseline"));
}

#[test]
fn tcp_with_large_clusters_and_a_large_unit() {
    let unit = CopyUnit { cluster_bytes: 4096, clusters: 64, channel: Channel::SharedMemory };
    bounded(120, move || exchange(unit, 0.0, "large"));
}

/// The side that closes second (from CLOSE-WAIT) still has bytes queued while the reader's window
/// is shut: they must all arrive once the reader reads, the FIN after them.
#[test]
fn bytes_queued_behind_a_shut_window_survive_the_second_close() {
    bounded(60, || {
        let p = pair("lastack", 0.0);
        let ca = StackClient::attach(&p.sock_a, CopyUnit::BASELINE).unwrap();
        let cb = StackClient::attach(&p.sock_b, CopyUnit::BASELINE).unwrap();
        let listener = cb.listen(7010, 1).unwrap();
        let mut s = ca.connect(SocketAddrV4::new(B, 7010)).unwrap();
        s.shutdown_write().unwrap();
        let (mut peer_side, _) = listener.accept().unwrap();
        assert!(read_all(&mut peer_side).is_empty());
        // More than A's window holds while nobody reads there, less than B queues.
        let down = pattern(1 << 20, 3);
        peer_side.write_all(&down).unwrap();
        drop(peer_side);
        // B closes behind its queued bytes; let it give up on A's shut window for a while.
        std::thread::sleep(Duration::from_millis(1500));
        assert_same(&read_all(&mut s), &down, "the bytes B sent before closing");
    });
}

#[test]
fn refused_reset_and_ports_in_use_give_linux_errors() {
    bounded(60, || {
        let p = pair("errors", 0.0);
        let ca = StackClient::attach(&p.sock_a, CopyUnit::DEFAULT).unwrap();
        let cb = StackClient::attach(&p.sock_b, CopyUnit::DEFAULT).unwrap();
        let e = ca.connect(SocketAddrV4::new(B, 7001)).err().expect("nobody listens there");
        assert_eq!(e.raw_os_error(), Some(libc::ECONNREFUSED), "{e}");
        // Two programs cannot listen on one port.
        let l = cb.listen(7002, 1).unwrap();
        let cb2 = StackClient::attach(&p.sock_b, CopyUnit::DEFAULT).unwrap();
        assert_eq!(cb2.listen(7002, 1).err().and_then(|e| e.raw_os_error()), Some(libc::EADDRINUSE));
        // The peer's RST: a read gives ECONNRESET, a write EPIPE or ECONNRESET.
        let mut s = ca.connect(SocketAddrV4::new(B, 7002)).unwrap();
        let (peer_side, _) = l.accept().unwrap();
        peer_side.abort();
        let mut buf = [0u8; 16];
        let e = s.read(&mut buf).expect_err("reset");
        assert_eq!(e.raw_os_error(), Some(libc::ECONNRESET), "{e}");
        assert!(s.write(b"x").is_err());
    });
}

#[test]
fn a_vanished_peer_times_out() {
    bounded(60, || {
        let p = pair("vanish", 0.0);
        let ca = StackClient::attach(&p.sock_a, CopyUnit::DEFAULT).unwrap();
        let cb = StackClient::attach(&p.sock_b, CopyUnit::DEFAULT).unwrap();
        let l = cb.listen(7003, 1).unwrap();
        let mut s = ca.connect(SocketAddrV4::new(B, 7003)).unwrap();
        let (_peer_side, _) = l.accept().unwrap();
        // B's whole stack goes away without a word; A's unacknowledged bytes time out.
        drop(cb);
        drop(p.b);
        s.write_all(b"is anybody there").unwrap();
        let mut buf = [0u8; 16];
        let e = s.read(&mut buf).expect_err("timed out");
        assert_eq!(e.raw_os_error(), Some(libc::ETIMEDOUT), "{e}");
    });
}

#[test]
fn udp_datagrams_both_ways() {
    bounded(60, || {
        let p = pair("udp", 0.0);
        let ca = StackClient::attach(&p.sock_a, CopyUnit::DEFAULT).unwrap();
        let cb = StackClient::attach(&p.sock_b, CopyUnit::DEFAULT).unwrap();
        let ua = ca.bind_udp(0).unwrap();
        let ub = cb.bind_udp(9000).unwrap();
        let mut buf = [0u8; 2048];
        for i in 0..20u8 {
            let msg = vec![i; 100 + usize::from(i) * 50];
            ua.send_to(&msg, SocketAddrV4::new(B, 9000)).unwrap();
            let (n, from) = ub.recv_from(&mut buf, Some(Duration::from_secs(5))).unwrap();
            assert_eq!(&buf[..n], &msg[..]);
            assert_eq!(from, ua.local_addr().to_string().parse().unwrap());
            ub.send_to(&buf[..n], from).unwrap();
            let (n, _) = ua.recv_from(&mut buf, Some(Duration::from_secs(5))).unwrap();
            assert_eq!(&buf[..n], &msg[..]);
        }
    });
}

#[test]
fn many_connections_open_move_bytes_and_close_without_leaks() {
    bounded(120, || {
        let p = pair("many", 0.0);
        let ca = StackClient::attach(&p.sock_a, CopyUnit::DEFAULT).unwrap();
        let cb = StackClient::attach(&p.sock_b, CopyUnit::DEFAULT).unwrap();
        let l = cb.listen(7004, 64).unwrap();
        const N: usize = 200;
        let mut conns = Vec::new();
        let mut accepted = Vec::new();
        for _ in 0..N {
            conns.push(ca.connect(SocketAddrV4::new(B, 7004)).unwrap());
            accepted.push(l.accept().unwrap().0);
        }
        for (i, (c, a)) in conns.iter_mut().zip(accepted.iter_mut()).enumerate() {
            let msg = format!("connection {i}");
            c.write_all(msg.as_bytes()).unwrap();
            c.shutdown_write().unwrap();
            assert_eq!(read_all(a), msg.as_bytes());
        }
        drop(accepted);
        drop(conns);
        drop(l);
        // Every connection's state is freed on both sides once TCP is done with it (the status
        // is a snapshot taken every 100 ms: wait for one that shows it).
        let n = N as u64;
        settled(&p.a, |st| {
            st.connections.is_empty()
                && st.counters.connections_opened == n
                && st.counters.connections_freed == n
        });
        settled(&p.b, |st| {
            st.connections.is_empty() && st.counters.connections_freed == n && st.listening.is_empty()
        });
    });
}

/// Waits (up to 30 s) for the server's status, refreshed every 100 ms, to satisfy `ok`.
fn settled(server: &Server, ok: impl Fn(&crate::server::ServerStatus) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let st = server.status();
        if ok(&st) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "status never settled: {st:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A client that speaks the protocol by hand over the Unix socket channel.
fn raw_client(path: &PathBuf) -> UnixStream {
    let mut s = UnixStream::connect(path).unwrap();
    let mut h = [0u8; hello::LEN];
    h[..8].copy_from_slice(hello::MAGIC);
    h[8] = 1;
    h[12..16].copy_from_slice(&2048u32.to_le_bytes());
    h[16..20].copy_from_slice(&1u32.to_le_bytes());
    s.write_all(&h).unwrap();
    let mut answer = [0u8; hello::ANSWER_LEN];
    s.read_exact(&mut answer).unwrap();
    assert_eq!(&answer[..8], hello::MAGIC);
    s
}

fn send_raw(s: &mut UnixStream, msg: Msg<'_>) {
    let mut buf = vec![0u8; 4 + msg.len()];
    buf[..4].copy_from_slice(&(msg.len() as u32).to_le_bytes());
    msg.emit(&mut buf[4..]).unwrap();
    s.write_all(&buf).unwrap();
}

#[test]
fn a_client_that_dies_mid_transfer_is_cleaned_up_and_others_go_on() {
    bounded(60, || {
        let p = pair("dies", 0.0);
        let cb = StackClient::attach(&p.sock_b, CopyUnit::DEFAULT).unwrap();
        let l = cb.listen(7005, 4).unwrap();
        let mut raw = raw_client(&p.sock_a);
        send_raw(&mut raw, Msg::Connect { req: 1, to: SocketAddrV4::new(B, 7005).into() });
        let (mut peer_side, _) = l.accept().unwrap();
        // The dying client had sent part of its data.
        // (Its connection handle is the server's; the client learns it from Opened.)
        std::thread::sleep(Duration::from_millis(200));
        drop(raw);
        // The server closes what the client left: its peer sees the end, not a hang.
        let mut buf = [0u8; 64];
        peer_side.set_read_timeout(Some(Duration::from_secs(10)));
        match peer_side.read(&mut buf) {
            Ok(0) => {}
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ECONNRESET), "{e}"),
            Ok(n) => panic!("{n} unexpected bytes"),
        }
        // Another client of the same server is unaffected.
        let ca = StackClient::attach(&p.sock_a, CopyUnit::DEFAULT).unwrap();
        let mut s = ca.connect(SocketAddrV4::new(B, 7005)).unwrap();
        let (mut t, _) = l.accept().unwrap();
        s.write_all(b"still here").unwrap();
        s.shutdown_write().unwrap();
        assert_eq!(read_all(&mut t), b"still here");
        settled(&p.a, |st| st.clients == 1 && st.counters.clients_broken == 0);
    });
}

#[test]
fn a_client_that_breaks_the_protocol_is_disconnected_and_nothing_else() {
    bounded(60, || {
        let p = pair("garbage", 0.0);
        let ca = StackClient::attach(&p.sock_a, CopyUnit::DEFAULT).unwrap();
        let cb = StackClient::attach(&p.sock_b, CopyUnit::DEFAULT).unwrap();
        let l = cb.listen(7006, 1).unwrap();
        let mut s = ca.connect(SocketAddrV4::new(B, 7006)).unwrap();
        let (mut t, _) = l.accept().unwrap();
        for garbage in [&[5u8, 0, 0, 0, 0xff, 0xff][..], &[24, 0, 0, 0, 200, 1, 2, 3]] {
            let mut raw = raw_client(&p.sock_a);
            raw.write_all(garbage).unwrap();
            let pad = vec![0u8; 24];
            let _ = raw.write_all(&pad);
            raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut buf = [0u8; 8];
            assert_eq!(raw.read(&mut buf).unwrap_or(0), 0, "the server hangs up on it");
        }
        // A message only a server sends, from a client, is a protocol error too.
        let mut raw = raw_client(&p.sock_a);
        send_raw(&mut raw, Msg::Eof { conn: 1 });
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(raw.read(&mut [0u8; 8]).unwrap_or(0), 0);
        // Sending on a handle it does not own reaches nothing.
        let mut raw = raw_client(&p.sock_a);
        send_raw(&mut raw, Msg::Send { conn: 1, data: b"not yours" });
        send_raw(&mut raw, Msg::Abort { conn: 1 });
        drop(raw);
        s.write_all(b"fine").unwrap();
        s.shutdown_write().unwrap();
        assert_eq!(read_all(&mut t), b"fine");
        settled(&p.a, |st| st.counters.clients_broken == 3 && st.clients == 1);
    });
}

#[test]
fn copy_units_parse_and_check() {
    assert_eq!("2048x16".parse::<CopyUnit>().unwrap().bytes(), 32768);
    assert_eq!("2048x1,socket".parse::<CopyUnit>().unwrap(), CopyUnit::BASELINE);
    assert_eq!(CopyUnit::DEFAULT.to_string().parse::<CopyUnit>().unwrap(), CopyUnit::DEFAULT);
    assert!("2048".parse::<CopyUnit>().is_err());
    assert!("100x1".parse::<CopyUnit>().is_err());
    assert!("65536x32".parse::<CopyUnit>().is_err());
    assert!("2048x0".parse::<CopyUnit>().is_err());
    assert!("2048x4,carrier-pigeon".parse::<CopyUnit>().is_err());
}

/// Writes `data` into a zero-copy stream in place, in chunks of the seeded sizes; every fifth
/// chunk waits between its reserve and its commit until the stack's buffer has emptied, so that
/// the commit lands where smoltcp no longer expects it and has to be moved.
fn zero_copy_send(s: &mut crate::client::ZeroCopyStream, data: &[u8], seed: u64, stale: bool) {
    let mut rng = seed;
    let mut at = 0;
    let mut chunk = 0;
    while at < data.len() {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let want = 1 + (rng >> 33) as usize % 90_000;
        let room = s.reserve().unwrap();
        let n = want.min(room.len()).min(data.len() - at);
        room[..n].copy_from_slice(&data[at..at + n]);
        chunk += 1;
        if stale && chunk % 5 == 0 {
            std::thread::sleep(Duration::from_millis(30));
        }
        s.commit(n).unwrap();
        at += n;
    }
}

#[test]
fn zero_copy_sends_from_the_shared_buffer_on_a_lossy_wire() {
    bounded(120, || {
        let p = pair("zero-copy", 0.005);
        let ca = StackClient::attach(&p.sock_a, CopyUnit::DEFAULT).unwrap();
        let cb = StackClient::attach(&p.sock_b, CopyUnit::DEFAULT).unwrap();
        let l = cb.listen(7010, 1).unwrap();
        let up = pattern(6 << 20, 3);
        let up2 = up.clone();
        let server = std::thread::spawn(move || {
            let (mut t, _) = l.accept().unwrap();
            assert_same(&read_all(&mut t), &up2, "the bytes committed in place");
            t.write_all(b"thanks").unwrap();
        });
        let mut s = ca.connect_zero_copy(SocketAddrV4::new(B, 7010)).unwrap();
        assert!(s.capacity() >= 64 << 10);
        zero_copy_send(&mut s, &up, 11, false);
        // The POSIX way: one copy into the shared buffer.
        s.drain().unwrap();
        s.shutdown_write().unwrap();
        assert_eq!(read_all(&mut s), b"thanks");
        server.join().unwrap();
        settled(&p.a, |st| st.counters.zero_copy_bytes + st.counters.zero_copy_moved_bytes == 6 << 20);
        assert!(p.a.status().counters.zero_copy_bytes >= (6 << 20) / 2, "{:?}", p.a.status().counters);
    });
}

#[test]
fn a_zero_copy_commit_the_stack_did_not_expect_is_moved_intact() {
    bounded(120, || {
        let p = pair("zero-copy-moved", 0.0);
        let ca = StackClient::attach(&p.sock_a, CopyUnit::DEFAULT).unwrap();
        let cb = StackClient::attach(&p.sock_b, CopyUnit::DEFAULT).unwrap();
        let l = cb.listen(7011, 1).unwrap();
        let up = pattern(3 << 20, 4);
        let last = b"and the last bytes through Write";
        let mut want = up.clone();
        want.extend_from_slice(last);
        let want_len = want.len();
        let server = std::thread::spawn(move || {
            let (mut t, _) = l.accept().unwrap();
            assert_same(&read_all(&mut t), &want, "the bytes committed, moved or not");
        });
        let mut s = ca.connect_zero_copy(SocketAddrV4::new(B, 7011)).unwrap();
        zero_copy_send(&mut s, &up, 12, true);
        // The POSIX way: one copy into the shared buffer.
        s.write_all(last).unwrap();
        s.shutdown_write().unwrap();
        server.join().unwrap();
        drop(s);
        settled(&p.a, |st| st.counters.tx_bytes == want_len as u64);
        let st = p.a.status();
        assert!(st.counters.zero_copy_moved_bytes > 0, "{:?}", st.counters);
        assert_eq!(st.counters.clients_broken, 0);
    });
}

#[test]
fn bad_zero_copy_requests_are_refused_or_disconnected() {
    bounded(60, || {
        let p = pair("zero-copy-bad", 0.0);
        let cb = StackClient::attach(&p.sock_b, CopyUnit::DEFAULT).unwrap();
        // Room in the backlog for every connection below (none is accepted until the end).
        let l = cb.listen(7012, 16).unwrap();
        // The Unix-socket channel has no shared memory to hand over.
        let sc = StackClient::attach(&p.sock_a, CopyUnit::BASELINE).unwrap();
        let e = sc.connect_zero_copy(SocketAddrV4::new(B, 7012)).err().expect("socket channel");
        assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP), "{e}");
        // Commits outside the buffer, or on a connection that copies, break the protocol.
        for bad in 0..3 {
            let ca = StackClient::attach(&p.sock_a, CopyUnit::DEFAULT).unwrap();
            let s = ca.connect_zero_copy(SocketAddrV4::new(B, 7012)).unwrap();
            let plain = ca.connect(SocketAddrV4::new(B, 7012)).unwrap();
            let cap = s.capacity() as u32;
            let msg = match bad {
                0 => Msg::Commit { conn: s.stream().handle(), offset: cap - 10, bytes: 11 },
                1 => Msg::Commit { conn: s.stream().handle(), offset: 0, bytes: 0 },
                _ => Msg::Commit { conn: plain.handle(), offset: 0, bytes: 10 },
            };
            ca.send_raw(&msg).unwrap();
            settled(&p.a, |st| st.counters.clients_broken == bad + 1);
        }
        // The server and its other clients go on.
        let ca = StackClient::attach(&p.sock_a, CopyUnit::DEFAULT).unwrap();
        let mut s = ca.connect_zero_copy(SocketAddrV4::new(B, 7012)).unwrap();
        s.write_all(b"still fine").unwrap();
        s.shutdown_write().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let (mut t, _) = l.accept().unwrap();
            if read_all(&mut t) == b"still fine" {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the good connection never arrived");
        }
    });
}

#[test]
fn tcp_and_udp_over_ipv6_beside_ipv4() {
    bounded(60, || {
        let p = pair("ipv6", 0.0);
        let ca = StackClient::attach(&p.sock_a, CopyUnit::DEFAULT).unwrap();
        let cb = StackClient::attach(&p.sock_b, CopyUnit::DEFAULT).unwrap();
        // One listener takes both families.
        let l = cb.listen(7020, 4).unwrap();
        let up = pattern(1 << 20, 5);
        let up2 = up.clone();
        let server = std::thread::spawn(move || {
            for want in [IpAddr::V6(A6), IpAddr::V4(A)] {
                let (mut t, peer) = l.accept().unwrap();
                assert_eq!(peer.ip(), want);
                assert_same(&read_all(&mut t), &up2, "over each family");
                t.write_all(b"back").unwrap();
            }
        });
        for to in
            [SocketAddr::V6(SocketAddrV6::new(B6, 7020, 0, 0)), SocketAddr::V4(SocketAddrV4::new(B, 7020))]
        {
            let mut s = ca.connect(to).unwrap();
            assert_eq!(s.local_addr().is_ipv6(), to.is_ipv6());
            s.write_all(&up).unwrap();
            s.shutdown_write().unwrap();
            assert_eq!(read_all(&mut s), b"back");
        }
        server.join().unwrap();
        // Datagrams.
        let ua = ca.bind_udp(9006).unwrap();
        let ub = cb.bind_udp(9007).unwrap();
        ua.send_to(b"six", SocketAddrV6::new(B6, 9007, 0, 0)).unwrap();
        let mut buf = [0u8; 16];
        let (n, from) = ub.recv_from(&mut buf, Some(Duration::from_secs(5))).unwrap();
        assert_eq!((&buf[..n], from), (&b"six"[..], SocketAddr::V6(SocketAddrV6::new(A6, 9006, 0, 0))));
    });
}

/// A fork as the preload library makes one, with two attachments of this process for parent and
/// child: only the ticket's secret, once, from the ticket's process, claims the parent's
/// connection; the parent's close leaves it open; the child's last close ends it.
#[test]
fn a_fork_ticket_hands_a_connection_to_its_child_alone() {
    bounded(60, || {
        let p = pair("fork", 0.0);
        let cb = StackClient::attach(&p.sock_b, CopyUnit::DEFAULT).unwrap();
        let l = cb.listen(7011, 4).unwrap();
        let parent = StackClient::attach(&p.sock_a, CopyUnit::DEFAULT).unwrap();
        let child = StackClient::attach(&p.sock_a, CopyUnit::BASELINE).unwrap();
        let stranger = StackClient::attach(&p.sock_a, CopyUnit::DEFAULT).unwrap();
        let s = parent.connect(SocketAddrV4::new(B, 7011)).unwrap();
        let (mut peer, _) = l.accept().unwrap();
        let (conn, local, remote) = (s.handle(), s.local_addr(), s.peer_addr());

        let token = parent.fork_ticket().unwrap();
        parent.forked(token, Some(std::process::id())).unwrap();
        let refused = |r: std::io::Result<u32>| r.unwrap_err().raw_os_error() == Some(libc::EPERM);
        assert!(refused(stranger.adopt(token ^ 1, &[conn])), "a guessed secret");
        // A ticket for another process: the one that ran `true` (it ended, too).
        let other = parent.fork_ticket().unwrap();
        let mut t = std::process::Command::new("true").spawn().unwrap();
        parent.forked(other, Some(t.id())).unwrap();
        t.wait().unwrap();
        // A request and its answer: the server has taken the report before the claim below
        // (a client's messages are served in order). A real child races its parent's report,
        // harmlessly: it is the process the report names.
        drop(parent.bind_udp(0).unwrap());
        assert!(refused(child.adopt(other, &[conn])), "another process's ticket");
        assert_eq!(child.adopt(token, &[conn]).unwrap(), 1);
        assert!(refused(stranger.adopt(token, &[conn])), "a ticket claimed already");

        // The parent closes its copy: the peer sees no end.
        drop(s);
        peer.set_read_timeout(Some(Duration::from_millis(300)));
        let mut buf = [0u8; 16];
        let e = peer.read(&mut buf).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "the parent's close ended the connection");
        // The stranger cannot use it either: its bytes go nowhere.
        stranger.send_raw(&Msg::Send { conn, data: b"not mine" }).unwrap();
        let mut c = child.adopted_stream(conn, local, remote);
        c.write_all(b"from the child").unwrap();
        peer.write_all(b"to the child").unwrap();
        let mut got = [0u8; 12];
        c.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"to the child");
        drop(c);
        peer.set_read_timeout(Some(Duration::from_secs(10)));
        assert_eq!(read_all(&mut peer), b"from the child");
        drop(peer);
        settled(&p.a, |st| {
            st.connections.is_empty()
                && st.counters.forks == 2
                && st.counters.forks_adopted == 1
                && st.counters.forks_refused == 3
                && st.counters.clients_broken == 0
        });
    });
}

/// A client that asks for fork tickets and never reports a child is refused past a bound, and
/// what its tickets held is freed when it goes.
#[test]
fn fork_tickets_without_children_are_bounded_and_go_with_their_client() {
    bounded(60, || {
        let p = pair("forks", 0.0);
        let cb = StackClient::attach(&p.sock_b, CopyUnit::DEFAULT).unwrap();
        let l = cb.listen(7012, 4).unwrap();
        let greedy = StackClient::attach(&p.sock_a, CopyUnit::DEFAULT).unwrap();
        let s = greedy.connect(SocketAddrV4::new(B, 7012)).unwrap();
        let (mut peer, _) = l.accept().unwrap();
        for _ in 0..64 {
            greedy.fork_ticket().unwrap();
        }
        let e = greedy.fork_ticket().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EAGAIN), "{e}");
        // The client goes: its connection and the tickets' references with it.
        drop(s);
        drop(greedy);
        peer.set_read_timeout(Some(Duration::from_secs(10)));
        assert_eq!(read_all(&mut peer), b"");
        drop(peer);
        settled(&p.a, |st| {
            st.clients == 0
                && st.connections.is_empty()
                && st.counters.forks == 64
                && st.counters.forks_refused == 1
                && st.counters.clients_broken == 0
        });
    });
}
