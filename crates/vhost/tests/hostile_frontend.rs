//! Frontends that break the vhost-user protocol (a message whose size does not match its type,
//! a memory table the backend cannot map, random bytes) lose their connection; the backend
//! stays up and serves the next frontend as if nothing had happened.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanbus_block::MemDevice;
use lanbus_vhost::{serve_blk, BlkOptions, BlkServer};
use rand::{Rng, SeedableRng};
use vhost::vhost_user::message::VhostUserConfigFlags;
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserProtocolFeatures};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo};

mod common;

const VIRTIO_F_VERSION_1: u64 = 1 << 32;
const PROTOCOL_FEATURES: u64 = 1 << 30;

fn server(name: &str) -> (BlkServer, PathBuf) {
    let path = std::env::temp_dir().join(format!("lanbus-vhost-{name}-{}.sock", std::process::id()));
    let dev = Arc::new(MemDevice::new(8 << 20));
    let s = serve_blk(&path, dev, BlkOptions { queues: 2, ..BlkOptions::default() }).unwrap();
    (s, path)
}

/// A well-behaved frontend's first steps: the backend answers with its features, queue count
/// and configuration (capacity in sectors).
fn check_serves(path: &PathBuf) {
    let mut f = Frontend::connect(path, 2).expect("a new connection is accepted");
    f.set_owner().unwrap();
    let features = f.get_features().unwrap();
    assert_ne!(features & VIRTIO_F_VERSION_1, 0);
    f.set_features(VIRTIO_F_VERSION_1 | PROTOCOL_FEATURES).unwrap();
    let pf = f.get_protocol_features().unwrap();
    assert!(pf.contains(VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ));
    f.set_protocol_features(VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ).unwrap();
    assert_eq!(f.get_queue_num().unwrap(), 2);
    let (_, cfg) = f.get_config(0, 8, VhostUserConfigFlags::WRITABLE, &[0u8; 8]).unwrap();
    assert_eq!(u64::from_le_bytes(cfg[..8].try_into().unwrap()), (8 << 20) / 512);
}

/// Reads until the backend closes the connection; false if it is still open after 5 s.
fn closed_by_backend(mut s: UnixStream) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let t = Instant::now();
    let mut buf = [0u8; 256];
    while t.elapsed() < Duration::from_secs(5) {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return true,
        }
    }
    false
}

fn header(request: u32, size: u32) -> Vec<u8> {
    // struct VhostUserMsg header: request, flags (version 1), size; little-endian.
    [request.to_le_bytes(), 1u32.to_le_bytes(), size.to_le_bytes()].concat()
}

#[test]
fn a_message_of_the_wrong_size_ends_that_connection_only() {
    let (s, path) = server("size");
    // GET_FEATURES carries no body; SET_FEATURES carries 8 bytes: here 4 and 4096.
    for msg in [[header(1, 4), vec![0; 4]].concat(), [header(2, 4096), vec![0; 64]].concat()] {
        let mut c = UnixStream::connect(&path).unwrap();
        c.write_all(&msg).unwrap();
        assert!(closed_by_backend(c), "the backend hangs up on a malformed message");
        check_serves(&path);
    }
    assert!(s.stats().protocol_errors.load(Ordering::Relaxed) >= 2);
    s.stop();
    assert!(!path.exists(), "the socket is removed when stopped");
}

#[test]
fn a_memory_table_that_cannot_be_mapped_is_refused() {
    let (s, path) = server("mem");
    let file_path = std::env::temp_dir().join(format!("lanbus-vhost-mem-{}", std::process::id()));
    let file = std::fs::File::create(&file_path).unwrap();
    file.set_len(4096).unwrap();
    let (sock, _other_end) = UnixStream::pair().unwrap();
    let bad_tables = [
        // 1 MiB mapped from a 4 KiB file
        VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: 1 << 20,
            userspace_addr: 0x7000_0000,
            mmap_offset: 0,
            mmap_handle: file.as_raw_fd(),
        },
        // a socket is not mappable
        VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: 4096,
            userspace_addr: 0x7000_0000,
            mmap_offset: 0,
            mmap_handle: sock.as_raw_fd(),
        },
        // an offset past the end of everything
        VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: 4096,
            userspace_addr: 0x7000_0000,
            mmap_offset: u64::MAX - 100,
            mmap_handle: file.as_raw_fd(),
        },
    ];
    for region in bad_tables {
        let f = Frontend::connect(&path, 2).unwrap();
        f.set_owner().unwrap();
        f.get_features().unwrap();
        f.set_features(VIRTIO_F_VERSION_1).unwrap();
        // Without REPLY_ACK the frontend does not wait for an answer: the error shows as the
        // connection closing, which the next request sees.
        let _ = f.set_mem_table(&[region]);
        let t = Instant::now();
        while f.get_features().is_ok() {
            assert!(t.elapsed() < Duration::from_secs(5), "the connection stays open after a bad table");
            std::thread::sleep(Duration::from_millis(20));
        }
        check_serves(&path);
    }
    drop(sock);
    std::fs::remove_file(&file_path).unwrap();
    s.stop();
}

#[test]
fn read_only_and_queue_count_are_offered() {
    let path = std::env::temp_dir().join(format!("lanbus-vhost-ro-{}.sock", std::process::id()));
    let dev = Arc::new(MemDevice::new(1 << 20));
    let s =
        serve_blk(&path, dev.clone(), BlkOptions { read_only: true, queues: 3, serial: "x".into() }).unwrap();
    let mut f = Frontend::connect(&path, 3).unwrap();
    f.set_owner().unwrap();
    let features = f.get_features().unwrap();
    assert_ne!(features & (1 << 5), 0, "VIRTIO_BLK_F_RO");
    for bit in [2, 6, 9, 12, 13, 14, 29] {
        assert_ne!(features & (1 << bit), 0, "feature bit {bit}");
    }
    f.set_features(VIRTIO_F_VERSION_1 | PROTOCOL_FEATURES).unwrap();
    f.get_protocol_features().unwrap();
    f.set_protocol_features(VhostUserProtocolFeatures::MQ).unwrap();
    assert_eq!(f.get_queue_num().unwrap(), 3);
    drop(f);
    s.stop();
    // Bad options are refused before anything is bound.
    assert!(serve_blk(&path, dev, BlkOptions { queues: 0, ..BlkOptions::default() }).is_err());
    assert!(!path.exists());
}

#[test]
fn random_bytes_never_take_the_backend_down() {
    let (s, path) = server("fuzz");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for _ in 0..40 {
        let mut c = UnixStream::connect(&path).unwrap();
        // A plausible header (a known request code, version 1) or none, then junk.
        let mut msg = if rng.random_bool(0.5) {
            header(rng.random_range(0..50), rng.random_range(0..300))
        } else {
            vec![]
        };
        let n = rng.random_range(0..200);
        msg.extend((0..n).map(|_| rng.random::<u8>()));
        let _ = c.write_all(&msg);
        // The frontend stops sending: whatever the backend made of the bytes, it ends the
        // connection rather than wait for the rest of a message.
        let _ = c.shutdown(std::net::Shutdown::Write);
        assert!(closed_by_backend(c), "{msg:?}");
    }
    check_serves(&path);
    s.stop();
}

/// A frontend that sets up a queue in shared memory and plays a hostile guest: buffers outside
/// its memory, ranges past the disk's end, a chain whose next index is out of the table, an
/// available index far ahead. Each bad request completes with an error status (or, with nowhere
/// to put one, with nothing written); good requests around them still work.
mod rings {
    use super::*;
    use common::{Ring, SharedMem};
    use vhost::vhost_user::VhostUserProtocolFeatures as Pf;
    use vm_memory::{Bytes, GuestAddress};

    const MEM_BYTES: usize = 1 << 20;

    fn header(g: &Ring, at: u64, kind: u32, sector: u64) {
        g.mem.write_obj(kind, GuestAddress(at)).unwrap();
        g.mem.write_obj(0u32, GuestAddress(at + 4)).unwrap();
        g.mem.write_obj(sector, GuestAddress(at + 8)).unwrap();
    }

    fn status(g: &Ring, at: u64) -> u8 {
        g.mem.read_obj(GuestAddress(at)).unwrap()
    }

    #[test]
    fn hostile_rings_get_error_statuses_and_good_requests_still_work() {
        let (s, path) = server("rings");
        let shared = SharedMem::new("rings", MEM_BYTES);
        let mut f = Frontend::connect(&path, 2).unwrap();
        f.set_owner().unwrap();
        f.get_features().unwrap();
        f.set_features(VIRTIO_F_VERSION_1 | PROTOCOL_FEATURES).unwrap();
        f.get_protocol_features().unwrap();
        f.set_protocol_features(Pf::MQ | Pf::CONFIG).unwrap();
        shared.share(&mut f);
        let mut g = Ring::setup(&mut f, &shared, 0, 0, true);
        let (hdr, data, st) = (0x10000u64, 0x20000u64, 0x30000u64);
        let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 5) as u8).collect();
        g.mem.write_slice(&pattern, GuestAddress(data)).unwrap();
        let (t_in, t_out) = (0u32, 1u32);
        let (ok, ioerr) = (0u8, 1u8);
        let run = |g: &mut Ring, kind: u32, sector: u64, bufs: &[(u64, u32, bool)]| {
            header(g, hdr, kind, sector);
            g.mem.write_obj(0xffu8, GuestAddress(st)).unwrap();
            let mut all = vec![(hdr, 16, false)];
            all.extend_from_slice(bufs);
            let head = g.chain(&all);
            g.publish(head);
            let used = g.next_used();
            assert_eq!(used.0, u32::from(head));
            (used.1, status(g, st))
        };
        // A good write of 4 KiB at sector 8.
        assert_eq!(run(&mut g, t_out, 8, &[(data, 4096, false), (st, 1, true)]), (1, ok));
        // Data buffer outside guest memory; a read past the end; an unaligned length.
        assert_eq!(run(&mut g, t_in, 0, &[(1 << 40, 4096, true), (st, 1, true)]), (1, ioerr));
        assert_eq!(run(&mut g, t_in, (8 << 20) / 512, &[(data, 512, true), (st, 1, true)]), (1, ioerr));
        assert_eq!(run(&mut g, t_out, 0, &[(data, 100, false), (st, 1, true)]), (1, ioerr));
        // A chain that runs out of the table: no status byte reached, completed with nothing.
        header(&g, hdr, t_in, 0);
        let head = g.desc(hdr, 16, common::VIRTQ_DESC_F_NEXT, 999);
        g.publish(head);
        assert_eq!(g.next_used(), (u32::from(head), 0));
        // A good read brings back the good write.
        let back = 0x40000u64;
        assert_eq!(run(&mut g, t_in, 8, &[(back, 4096, true), (st, 1, true)]), (4097, ok));
        let mut got = vec![0u8; 4096];
        g.mem.read_slice(&mut got, GuestAddress(back)).unwrap();
        assert_eq!(got, pattern);
        // An available index far ahead of the ring: the backend completes nothing more.
        g.mem.write_obj(g.avail_idx.wrapping_add(1000), GuestAddress(g.avail() + 2)).unwrap();
        g.kick.write(1).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(g.used_idx(), g.seen);
        drop(f);
        // The backend takes the next frontend.
        check_serves(&path);
        assert!(s.stats().io_errors.load(Ordering::Relaxed) >= 3);
        assert!(s.stats().malformed.load(Ordering::Relaxed) >= 1);
        s.stop();
    }
}
