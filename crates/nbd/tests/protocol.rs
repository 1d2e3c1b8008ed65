//! The server against a hand-written client: handshake variants, every command, the error values,
//! requests completing out of order, several connections, hostile clients, and shutdown.

mod common;

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use lanbus_block::{BlockDevice, DeviceError, MemDevice};
use lanbus_nbd::proto::*;
use lanbus_nbd::{Client, ClientError, Errno, Export, Stream};
use rand::{Rng, RngCore, SeedableRng};

fn raw(srv: &TestServer) -> UnixStream {
    let s = UnixStream::connect(&srv.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn read_n(s: &mut UnixStream, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    s.read_exact(&mut v).unwrap();
    v
}

/// Reads until the server closes; true if it did within the read timeout.
fn closed_by_server(s: &mut UnixStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

fn option(opt: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = OptionHeader { option: opt, length: payload.len() as u32 }.emit().to_vec();
    v.extend_from_slice(payload);
    v
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn handshake_variants() {
    let (_, export) = mem_export("export", 1 << 20);
    let (_, second) = mem_export("second", 2 << 20);
    let srv = TestServer::start("handshake", vec![export.description("first"), second]);

    // GO by name, by the empty (default) name, over TCP.
    let c = Client::connect_unix(&srv.socket, "second").unwrap();
    assert_eq!(c.size_bytes(), 2 << 20);
    assert_eq!(c.block_sizes(), Some((512, 4096, MAX_PAYLOAD_BYTES)));
    let flags = c.transmission_flags();
    for f in [TFLAG_HAS_FLAGS, TFLAG_SEND_FLUSH, TFLAG_SEND_FUA, TFLAG_SEND_TRIM, TFLAG_SEND_WRITE_ZEROES] {
        assert!(flags & f != 0, "flag {f:#x} missing from {flags:#x}");
    }
    assert!(flags & TFLAG_CAN_MULTI_CONN != 0 && flags & TFLAG_READ_ONLY == 0);
    drop(c); // closed without DISC: allowed, not counted as a protocol error
    assert_eq!(Client::connect_unix(&srv.socket, "").unwrap().size_bytes(), 1 << 20);
    assert_eq!(Client::connect_tcp(srv.tcp.unwrap(), "export").unwrap().size_bytes(), 1 << 20);
    match Client::connect_unix(&srv.socket, "nope") {
        Err(ClientError::Refused { reply, .. }) => assert_eq!(reply, REP_ERR_UNKNOWN),
        other => panic!("unknown export: {:?}", other.err()),
    }
    let listed = Client::list_unix(&srv.socket).unwrap();
    assert_eq!(listed.len(), 2);
    assert_eq!((listed[0].name.as_str(), listed[0].description.as_str()), ("export", "first"));

    // EXPORT_NAME, without NO_ZEROES: 8 + 2 + 124 bytes, then transmission works.
    let mut s = raw(&srv);
    let greeting = read_n(&mut s, 18);
    assert_eq!(&greeting[..16], b"NBDMAGICIHAVEOPT");
    assert_eq!(u16::from_be_bytes([greeting[16], greeting[17]]), FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    s.write_all(&CLIENT_FLAG_FIXED_NEWSTYLE.to_be_bytes()).unwrap();
    s.write_all(&option(OPT_STRUCTURED_REPLY, &[])).unwrap();
    let r = OptionReplyHeader::parse(&read_n(&mut s, 20)).unwrap();
    assert_eq!((r.option, r.reply), (OPT_STRUCTURED_REPLY, REP_ERR_UNSUP));
    read_n(&mut s, r.length as usize);
    s.write_all(&option(OPT_EXPORT_NAME, b"second")).unwrap();
    let reply = read_n(&mut s, 134);
    assert_eq!(u64::from_be_bytes(reply[..8].try_into().unwrap()), 2 << 20);
    assert!(reply[10..].iter().all(|&b| b == 0));
    let mut c = Client::from_transmission(Stream::Unix(s), 2 << 20, 0).unwrap();
    c.write(0, &[9; 512], false).unwrap();
    let mut back = [0u8; 512];
    c.read(0, &mut back).unwrap();
    assert_eq!(back, [9; 512]);
    c.disconnect().unwrap();

    // EXPORT_NAME for an unknown export: the server closes (the spec has no error reply for it).
    let mut s = raw(&srv);
    read_n(&mut s, 18);
    s.write_all(&3u32.to_be_bytes()).unwrap();
    s.write_all(&option(OPT_EXPORT_NAME, b"missing")).unwrap();
    assert!(closed_by_server(&mut s));

    // ABORT gets an ACK.
    let mut s = raw(&srv);
    read_n(&mut s, 18);
    s.write_all(&3u32.to_be_bytes()).unwrap();
    s.write_all(&option(OPT_ABORT, &[])).unwrap();
    let r = OptionReplyHeader::parse(&read_n(&mut s, 20)).unwrap();
    assert_eq!((r.option, r.reply, r.length), (OPT_ABORT, REP_ACK, 0));
    assert!(closed_by_server(&mut s));
    wait_for("connections to close", || srv.server.stats().connections_active == 0);
    assert_eq!(srv.server.stats().protocol_disconnects, 1, "only the unknown EXPORT_NAME counts");
}

#[test]
fn every_command_and_its_errors() {
    let dev = Arc::new(MemDevice::new(64 << 20));
    let ro = Arc::new(MemDevice::new(1 << 20));
    let srv = TestServer::start(
        "commands",
        vec![
            Export::new("export", dev.clone() as Arc<dyn BlockDevice>),
            Export::new("ro", ro.clone() as Arc<dyn BlockDevice>).read_only(true),
        ],
    );
    let mut c = Client::connect_unix(&srv.socket, "export").unwrap();
    let data: Vec<u8> = (0..256 << 10).map(|i| (i % 251) as u8).collect();
    c.write(1 << 20, &data, false).unwrap();
    c.write((1 << 20) + data.len() as u64, &data[..4096], true).unwrap();
    let mut back = vec![0u8; data.len()];
    c.read(1 << 20, &mut back).unwrap();
    assert_eq!(back, data);
    assert_eq!(read_all(&*dev, 1 << 20, data.len()), data);
    c.flush().unwrap();
    c.write_zeroes((1 << 20) + 4096, 8192, false).unwrap();
    c.write_zeroes((1 << 20) + 16384, 4096, true).unwrap();
    let now = read_all(&*dev, 1 << 20, 32768);
    assert_eq!(&now[..4096], &data[..4096]);
    assert!(now[4096..12288].iter().all(|&b| b == 0));
    assert_eq!(&now[12288..16384], &data[12288..16384]);
    assert!(now[16384..20480].iter().all(|&b| b == 0));
    c.trim(1 << 20, 1 << 20).unwrap();
    // A zero-length read is a no-op that succeeds.
    c.read(0, &mut []).unwrap();

    let err = |r: Result<(), ClientError>| match r {
        Err(ClientError::Request(e)) => e,
        other => panic!("expected an NBD error, got {other:?}"),
    };
    let end = 64u64 << 20;
    assert_eq!(err(c.read(end - 512, &mut [0; 1024])), Errno::Inval);
    assert_eq!(err(c.read(u64::MAX - 511, &mut [0; 1024])), Errno::Inval);
    assert_eq!(err(c.write(end - 512, &[0; 1024], false)), Errno::NoSpc);
    assert_eq!(err(c.write(end, &[0; 512], false)), Errno::NoSpc);
    assert_eq!(err(c.write_zeroes(end, 512, false)), Errno::NoSpc);
    assert_eq!(err(c.trim(end, 512)), Errno::Inval);
    assert_eq!(err(c.read(100, &mut [0; 512])), Errno::Inval, "misaligned offset");
    assert_eq!(err(c.write(0, &[0; 100], false)), Errno::Inval, "misaligned length");
    // Oversized READ and WRITE: refused; the WRITE's payload is consumed and the connection lives.
    let h = c.submit(Command::Read, 0, 0, MAX_PAYLOAD_BYTES + 512, &[]).unwrap();
    let done = c.complete().unwrap();
    assert_eq!((done.handle, done.error), (h, 22));
    let big = vec![0x5a; MAX_PAYLOAD_BYTES as usize + 4096];
    assert_eq!(err(c.write(0, &big, false)), Errno::Inval);
    assert!(read_all(&*dev, 0, 8192).iter().all(|&b| b == 0), "refused write left no trace");
    // Unknown command and unknown flags.
    for (cmd, flags) in [(Command::Unknown(5), 0), (Command::Unknown(200), 0), (Command::Read, 1 << 9)] {
        let h = c.submit(cmd, flags, 0, 512, &[]).unwrap();
        let done = c.complete().unwrap();
        assert_eq!((done.handle, done.error), (h, 22), "{cmd:?} {flags:#x}");
    }
    // Exactly the last block works.
    c.write(end - 512, &[3; 512], false).unwrap();
    let mut last = [0u8; 512];
    c.read(end - 512, &mut last).unwrap();
    assert_eq!(last, [3; 512]);
    c.disconnect().unwrap();

    let mut r = Client::connect_unix(&srv.socket, "ro").unwrap();
    assert!(r.transmission_flags() & TFLAG_READ_ONLY != 0);
    assert!(r.transmission_flags() & TFLAG_SEND_TRIM == 0);
    assert_eq!(err(r.write(0, &[1; 512], false)), Errno::Perm);
    assert_eq!(err(r.trim(0, 512)), Errno::Perm);
    assert_eq!(err(r.write_zeroes(0, 512, false)), Errno::Perm);
    r.read(0, &mut [0; 512]).unwrap();
    r.flush().unwrap();
    r.disconnect().unwrap();
    assert!(read_all(&*ro, 0, 512).iter().all(|&b| b == 0));

    wait_for("connections to close", || srv.server.stats().connections_active == 0);
    let stats = srv.server.stats();
    assert_eq!(stats.protocol_disconnects, 0, "{stats:?}");
    assert_eq!(stats.requests_disc, 2);
    assert!(stats.requests_refused >= 16, "{stats:?}");
    assert_eq!(stats.requests_trim, 3);
    assert_eq!(stats.requests_write_zeroes, 4);
}

#[test]
fn replies_come_back_out_of_order() {
    let dev = Arc::new(GatedDevice::new(1 << 20));
    dev.inner.write_at(4096, &[0x42; 4096], false).unwrap();
    let srv = TestServer::start("order", vec![Export::new("export", dev.clone() as Arc<dyn BlockDevice>)]);
    let mut c = Client::connect_unix(&srv.socket, "export").unwrap();
    let slow = c.submit(Command::Read, 0, 0, 4096, &[]).unwrap();
    dev.wait_blocked(1);
    let fast = c.submit(Command::Read, 0, 4096, 4096, &[]).unwrap();
    let w = c.submit(Command::Write, 0, 8192, 512, &[7; 512]).unwrap();
    let mut first_two = [c.complete().unwrap(), c.complete().unwrap()];
    first_two.sort_by_key(|d| d.handle);
    assert_eq!(first_two[0].handle, fast, "the fast read finished while the slow one waits");
    assert_eq!(first_two[0].data, vec![0x42; 4096]);
    assert_eq!((first_two[1].handle, first_two[1].error), (w, 0));
    dev.open_gate();
    let last = c.complete().unwrap();
    assert_eq!((last.handle, last.data.len()), (slow, 4096));
    c.disconnect().unwrap();
}

#[test]
fn many_requests_in_flight_on_several_connections_match_a_model() {
    const CONNS: usize = 4;
    const REGION: u64 = 4 << 20;
    let (dev, export) = mem_export("export", REGION * CONNS as u64);
    let srv =
        TestServer::start_with("inflight", vec![export], |b| b.workers_per_connection(3).queue_depth(8));
    let threads: Vec<_> = (0..CONNS)
        .map(|i| {
            let socket = srv.socket.clone();
            let tcp = srv.tcp.unwrap();
            std::thread::spawn(move || {
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(i as u64);
                let mut c = if i % 2 == 0 {
                    Client::connect_unix(&socket, "export").unwrap()
                } else {
                    Client::connect_tcp(tcp, "export").unwrap()
                };
                let base = REGION * i as u64;
                let mut model = vec![0u8; REGION as usize];
                for _round in 0..8 {
                    // A burst of writes to disjoint blocks, all in flight at once.
                    let mut blocks: Vec<u64> = (0..REGION / 65536).collect();
                    for k in (1..blocks.len()).rev() {
                        blocks.swap(k, rng.random_range(0..=k));
                    }
                    for &b in blocks.iter().take(24) {
                        let len = 512 * rng.random_range(1..=128usize);
                        let mut data = vec![0u8; len];
                        rng.fill_bytes(&mut data);
                        let off = b * 65536;
                        model[off as usize..off as usize + len].copy_from_slice(&data);
                        c.submit(Command::Write, 0, base + off, len as u32, &data).unwrap();
                    }
                    let mut ok = 0;
                    while c.in_flight() > 0 {
                        assert_eq!(c.complete().unwrap().error, 0);
                        ok += 1;
                    }
                    assert_eq!(ok, 24);
                    // Then reads in flight, checked against the model whatever order they return.
                    reads_match_model(&mut c, &mut rng, base, &model, 16, 128);
                }
                c.flush().unwrap();
                c.disconnect().unwrap();
                model
            })
        })
        .collect();
    for (i, t) in threads.into_iter().enumerate() {
        let model = t.join().unwrap();
        assert!(read_all(&*dev, REGION * i as u64, REGION as usize) == model, "connection {i}'s region");
    }
    wait_for("connections to close", || srv.server.stats().connections_active == 0);
    let s = srv.server.stats();
    assert_eq!((s.requests_write, s.requests_read), (4 * 8 * 24, 4 * 8 * 16));
    assert_eq!(s.protocol_disconnects + s.device_errors + s.requests_refused, 0, "{s:?}");
}

#[test]
fn hostile_clients_are_cut_off_and_others_carry_on() {
    let (dev, export) = mem_export("export", 8 << 20);
    let srv = TestServer::start("hostile", vec![export]);
    let mut good = Client::connect_unix(&srv.socket, "export").unwrap();
    good.write(0, &[1; 4096], false).unwrap();

    let handshake = |srv: &TestServer| {
        let mut s = raw(srv);
        read_n(&mut s, 18);
        s
    };
    let transmitting = |srv: &TestServer| {
        let mut s = handshake(srv);
        s.write_all(&3u32.to_be_bytes()).unwrap();
        s.write_all(&option(OPT_EXPORT_NAME, b"export")).unwrap();
        read_n(&mut s, 10);
        s
    };
    let mut expected_disconnects = 0;
    let mut check = |s: &mut UnixStream, what: &str| {
        assert!(closed_by_server(s), "{what}: the server kept the connection");
        expected_disconnects += 1;
        wait_for(what, || srv.server.stats().protocol_disconnects == expected_disconnects);
    };

    // Handshake: client flags without fixed newstyle; garbage instead of IHAVEOPT; a 4 GiB option.
    let mut s = handshake(&srv);
    s.write_all(&0u32.to_be_bytes()).unwrap();
    check(&mut s, "no fixed newstyle");
    let mut s = handshake(&srv);
    s.write_all(&3u32.to_be_bytes()).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    check(&mut s, "garbage option");
    let mut s = handshake(&srv);
    s.write_all(&3u32.to_be_bytes()).unwrap();
    s.write_all(&OptionHeader { option: OPT_GO, length: u32::MAX }.emit()).unwrap();
    check(&mut s, "4 GiB option");
    // Close in the middle of an option.
    let mut s = handshake(&srv);
    s.write_all(&3u32.to_be_bytes()).unwrap();
    s.write_all(&OptionHeader { option: OPT_GO, length: 100 }.emit()).unwrap();
    s.write_all(&[0; 10]).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    check(&mut s, "close mid-option");

    // Transmission: bad request magic; random bytes; close mid-header; close mid-WRITE payload;
    // a 4 GiB WRITE header (refused; its payload would be discarded) then close.
    let mut s = transmitting(&srv);
    let mut bad =
        RequestHeader { flags: 0, command: Command::Read, handle: 1, offset: 0, length: 512 }.emit();
    bad[0] ^= 0xff;
    s.write_all(&bad).unwrap();
    check(&mut s, "bad request magic");
    let mut s = transmitting(&srv);
    let mut junk = vec![0u8; 4096];
    rand_chacha::ChaCha8Rng::seed_from_u64(99).fill_bytes(&mut junk);
    s.write_all(&junk).unwrap();
    check(&mut s, "random bytes");
    let mut s = transmitting(&srv);
    s.write_all(&bad[..10]).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    check(&mut s, "close mid-header");
    let mut s = transmitting(&srv);
    let w = RequestHeader { flags: 0, command: Command::Write, handle: 2, offset: 0, length: 1 << 20 };
    s.write_all(&w.emit()).unwrap();
    s.write_all(&[0xee; 1000]).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    check(&mut s, "close mid-payload");
    let mut s = transmitting(&srv);
    let w = RequestHeader { flags: 0, command: Command::Write, handle: 3, offset: 0, length: u32::MAX };
    s.write_all(&w.emit()).unwrap();
    s.write_all(&[0xee; 100_000]).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    check(&mut s, "4 GiB write then close");

    // The well-behaved client never noticed; none of the hostile bytes reached the device.
    let mut back = [0u8; 4096];
    good.read(0, &mut back).unwrap();
    assert_eq!(back, [1; 4096]);
    good.write(8192, &[2; 512], true).unwrap();
    good.disconnect().unwrap();
    assert!(read_all(&*dev, 4096, 4096).iter().all(|&b| b == 0));
    wait_for("connections to close", || srv.server.stats().connections_active == 0);
    assert_eq!(srv.server.stats().protocol_disconnects, 9);
}

#[test]
fn silent_or_slow_handshakes_time_out() {
    let (_, export) = mem_export("export", 1 << 20);
    let srv = TestServer::start_with("hs-timeout", vec![export], |b| {
        b.handshake_timeout(Duration::from_millis(300)).max_connections(2)
    });
    let t = Instant::now();
    let mut silent = raw(&srv);
    let mut trickle = raw(&srv);
    read_n(&mut trickle, 18);
    trickle.write_all(&3u32.to_be_bytes()).unwrap();
    // One byte of an option every 100 ms: each read is quick, the handshake as a whole is not.
    for b in option(OPT_GO, &emit_info_request(b"export", &[])).iter().take(8) {
        if trickle.write_all(&[*b]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(closed_by_server(&mut silent) && closed_by_server(&mut trickle));
    assert!(t.elapsed() < Duration::from_secs(5));
    wait_for("both counted", || srv.server.stats().protocol_disconnects == 2);
    // The slots are free again, and a prompt client is unaffected by the timeout.
    let mut c = Client::connect_unix(&srv.socket, "export").unwrap();
    std::thread::sleep(Duration::from_millis(400));
    c.flush().unwrap();
    c.disconnect().unwrap();
}

#[test]
fn connection_limit_refuses_extra_clients() {
    let (_, export) = mem_export("export", 1 << 20);
    let srv = TestServer::start_with("limit", vec![export], |b| b.max_connections(1));
    let mut first = Client::connect_unix(&srv.socket, "export").unwrap();
    let mut second = raw(&srv);
    assert!(closed_by_server(&mut second));
    first.flush().unwrap();
    assert_eq!(srv.server.stats().connections_refused, 1);
    first.disconnect().unwrap();
    wait_for("the first to close", || srv.server.stats().connections_active == 0);
    Client::connect_unix(&srv.socket, "export").unwrap().disconnect().unwrap();
}

#[test]
fn shutdown_finishes_requests_in_flight_and_flushes() {
    let dev = Arc::new(GatedDevice::new(1 << 20));
    let srv = TestServer::start("shutdown", vec![Export::new("export", dev.clone() as Arc<dyn BlockDevice>)]);
    let mut c = Client::connect_unix(&srv.socket, "export").unwrap();
    let mut idle = Client::connect_unix(&srv.socket, "export").unwrap();
    let slow = c.submit(Command::Read, 0, 0, 4096, &[]).unwrap();
    let write = c.submit(Command::Write, 0, 4096, 4096, &[0x33; 4096]).unwrap();
    dev.wait_blocked(1);
    // The write is done (its reply came back) before shutdown starts.
    assert_eq!(c.complete().unwrap().handle, write);
    let flushes_before = dev.flushes.load(Ordering::SeqCst);
    let server = srv.server.clone();
    let stopper = std::thread::spawn(move || server.shutdown());
    // Shutdown waits for the read parked in the device; new clients are no longer served.
    std::thread::sleep(Duration::from_millis(100));
    assert!(!stopper.is_finished(), "shutdown must wait for the request in flight");
    dev.open_gate();
    let done = c.complete().unwrap();
    assert_eq!((done.handle, done.error, done.data.len()), (slow, 0, 4096));
    let stats = stopper.join().unwrap().unwrap();
    assert!(dev.flushes.load(Ordering::SeqCst) > flushes_before, "shutdown flushed the device");
    assert_eq!(stats.connections_active, 0);
    assert_eq!(stats.protocol_disconnects, 0, "{stats:?}");
    assert!(matches!(idle.flush(), Err(ClientError::Io(_))), "idle connection was closed");
    assert!(Client::connect_unix(&srv.socket, "export").is_err(), "no longer accepting");
    assert!(srv.server.shutdown().is_ok(), "shutdown is idempotent");
}

/// A device that lends its reads in pieces of 1000 bytes (odd ones, so replies are many slices
/// whose edges fall anywhere) and fails the reads it is told to.
struct LendingDevice {
    inner: MemDevice,
    fail_at: u64,
    lent: std::sync::atomic::AtomicU64,
}

impl BlockDevice for LendingDevice {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        self.inner.read_at(offset, buf)
    }
    fn read_lent(
        &self,
        offset: u64,
        len: usize,
        reply: &mut dyn FnMut(&[&[u8]]),
    ) -> Option<Result<(), DeviceError>> {
        if len < 4096 {
            return None;
        }
        if offset == self.fail_at {
            return Some(Err(DeviceError::Failed("failed".into())));
        }
        let mut buf = vec![0u8; len];
        if let Err(e) = self.inner.read_at(offset, &mut buf) {
            return Some(Err(e));
        }
        let pieces: Vec<&[u8]> = buf.chunks(1000).collect();
        // Counted before the reply goes: the client may see the reply before this thread
        // runs again.
        self.lent.fetch_add(1, Ordering::Relaxed);
        reply(&pieces);
        Some(Ok(()))
    }
    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        self.inner.write_at(offset, data, fua)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        self.inner.flush()
    }
}

#[test]
fn reads_a_device_lends_are_sent_from_its_slices() {
    let dev = Arc::new(LendingDevice {
        inner: MemDevice::new(8 << 20),
        fail_at: 4 << 20,
        lent: Default::default(),
    });
    let srv = TestServer::start("lent", vec![Export::new("export", dev.clone() as Arc<dyn BlockDevice>)]);
    let mut c = Client::connect_unix(&srv.socket, "export").unwrap();
    let data: Vec<u8> = (0..1 << 20).map(|i| (i * 7 % 253) as u8).collect();
    c.write(0, &data, false).unwrap();
    // Lent (4 KiB and more, in 1000-byte slices) and not (smaller): the same bytes either way,
    // and several requests in flight at once keep their replies whole.
    for len in [512usize, 4096, 65536, 1 << 20] {
        let mut back = vec![0u8; len];
        c.read(0, &mut back).unwrap();
        assert_eq!(back, data[..len], "{len} bytes");
    }
    let handles: Vec<u64> =
        (0..8u64).map(|i| c.submit(Command::Read, 0, i * 65536, 65536, &[]).unwrap()).collect();
    for _ in &handles {
        let done = c.complete().unwrap();
        assert_eq!(done.error, 0);
    }
    assert_eq!(dev.lent.load(Ordering::Relaxed), 3 + 8);
    // A lent read that fails is an error reply, and the connection goes on.
    match c.read(4 << 20, &mut [0u8; 8192]) {
        Err(ClientError::Request(e)) => assert_eq!(e, Errno::Io),
        other => panic!("expected EIO, got {other:?}"),
    }
    let mut back = vec![0u8; 8192];
    c.read(0, &mut back).unwrap();
    assert_eq!(back, data[..8192]);
    assert_eq!(srv.server.stats().device_errors, 1);
}

#[test]
fn a_large_read_reply_leaves_at_once_on_a_local_socket() {
    // A local socket's default send buffer (about 200 KiB) would hold the reply back until the
    // client read some of it; the server's wider buffer takes all of it in one call.
    let (dev, export) = mem_export("export", 4 << 20);
    let data: Vec<u8> = (0..256 << 10).map(|i| (i % 251) as u8).collect();
    dev.write_at(0, &data, false).unwrap();
    let srv = TestServer::start("widebuf", vec![export]);
    let mut c = Client::connect_unix(&srv.socket, "export").unwrap();
    let h = c.submit(Command::Read, 0, 0, data.len() as u32, &[]).unwrap();
    wait_for("the whole reply sent while the client reads nothing", || {
        let s = srv.server.stats();
        s.requests_read == 1 && s.reply_ns > 0
    });
    let done = c.complete().unwrap();
    assert_eq!((done.handle, done.error), (h, 0));
    assert_eq!(done.data, data);
    c.disconnect().unwrap();
}
