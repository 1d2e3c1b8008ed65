//! The `dpdk` port on a real wire: DPDK's `net_af_packet` virtual device on one end of a veth pair
//! (no hugepages, no PCI), a plain AF_PACKET socket on the other, frames both ways with every
//! byte checked. Needs root (namespaces); skips with a printed reason otherwise.
//!
//! DPDK's EAL can be initialised once per process, so everything that needs it is one test.
#![cfg(feature = "dpdk")]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use lanbus_port::dpdk::{self, DpdkOptions};
use lanbus_port::netns::VethPair;
use lanbus_port::{Port, PortError};
use lanbus_wire::MacAddr;

const LANBUS: u16 = 0x88B5;
/// Frames each way.
const FRAMES: u32 = 3000;
/// Frames in flight before the receiver catches up (well inside every ring and socket buffer).
const WINDOW: u32 = 100;
const MIN_LEN: usize = 60;
const MAX_LEN: usize = 1514;

/// Frame `seq` of direction `dir`: a lanbus Ethernet header, then the sequence number, the
/// direction, and bytes that depend on both; lengths sweep 60..=1514.
fn frame(dst: MacAddr, src: MacAddr, dir: u8, seq: u32) -> Vec<u8> {
    let len = MIN_LEN + (seq as usize * 97) % (MAX_LEN - MIN_LEN + 1);
    let mut f = Vec::with_capacity(len);
    f.extend_from_slice(&dst.0);
    f.extend_from_slice(&src.0);
    f.extend_from_slice(&LANBUS.to_be_bytes());
    f.extend_from_slice(&seq.to_be_bytes());
    f.push(dir);
    let mut i = 0u32;
    while f.len() < len {
        f.push((seq.wrapping_mul(31) ^ i.wrapping_mul(7) ^ u32::from(dir)) as u8);
        i += 1;
    }
    f
}

/// A raw AF_PACKET socket on `ifname` (in the calling thread's namespace), EtherType `proto`.
fn raw_socket(ifname: &str, proto: u16) -> std::io::Result<OwnedFd> {
    let name = std::ffi::CString::new(ifname).unwrap();
    // SAFETY: if_nametoindex reads a NUL-terminated string.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if ifindex == 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: plain socket(2) call; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto.to_be())) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor this function owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = proto.to_be();
    sll.sll_ifindex = ifindex as i32;
    // SAFETY: sll is a valid sockaddr_ll and the length matches it.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sll as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let tv = libc::timeval { tv_sec: 2, tv_usec: 0 };
    // SAFETY: SO_RCVTIMEO takes a timeval of the given size.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as u32,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

fn raw_send(fd: &OwnedFd, frame: &[u8]) {
    // SAFETY: the buffer is valid for its length.
    let n = unsafe { libc::send(fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
    assert_eq!(n, frame.len() as isize, "raw send: {}", std::io::Error::last_os_error());
}

fn raw_recv(fd: &OwnedFd, buf: &mut [u8]) -> usize {
    // SAFETY: the buffer is valid and writable for its length.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    assert!(n >= 0, "raw recv (2 s timeout): {}", std::io::Error::last_os_error());
    n as usize
}

/// The CPUs the calling thread may run on.
fn cpu_affinity() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; the size matches the set.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    assert_eq!(rc, 0, "sched_getaffinity: {}", std::io::Error::last_os_error());
    // SAFETY: CPU_ISSET reads the set within its size (CPU_SETSIZE bits).
    (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
}

/// The EAL's run directory for a `--file-prefix` (empty with `--no-shconf`), removed on drop.
struct RunDir(String);

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(format!("/var/run/dpdk/{}", self.0));
    }
}

#[test]
fn dpdk_af_packet_vdev_exchanges_frames_both_ways() {
    let pair = match VethPair::create() {
        Ok(p) => p,
        Err(skip) => {
            eprintln!("dpdk_af_packet_vdev_exchanges_frames_both_ways {skip}");
            return;
        }
    };
    let started = Instant::now();
    let (a_mac, b_mac) = (pair.a.mac, pair.b.mac);
    let prefix = RunDir(format!("lanbus-test-{}", std::process::id()));
    let eal_args = format!(
        "--no-huge --no-pci -m 256 --no-shconf --no-telemetry --file-prefix={} \
         --proc-type=primary -l 0 --log-level=notice --vdev=net_af_packet0,iface={} --vdev=net_ring0 --vdev=net_ring1",
        prefix.0, pair.a.ifname
    );
    // The vdev opens its socket during EAL init: do that inside a's namespace.
    let args = eal_args.clone();
    let (port, affinity_before, affinity_after) = pair
        .a
        .netns
        .run(move || {
            let before = cpu_affinity();
            let port = dpdk::open(&args, DpdkOptions::default());
            (port, before, cpu_affinity())
        })
        .unwrap();
    let mut port = port.unwrap();
    assert_eq!(affinity_before, affinity_after, "EAL init leaves the caller's CPU affinity alone");
    eprintln!("dpdk port open after {:?}: {port:?}", started.elapsed());
    assert_eq!(port.driver(), "net_af_packet");
    assert_eq!(port.mac(), a_mac, "the af_packet vdev takes the interface's MAC");
    assert_eq!(port.mtu(), 1500);
    assert_eq!(port.frame_capacity(), 1514);

    // The EAL is once per process: the same arguments again are fine, others are refused.
    dpdk::eal_init(&eal_args).unwrap();
    match dpdk::eal_init("--no-huge -m 64") {
        Err(PortError::Misuse(msg)) => assert!(msg.contains("already initialised"), "{msg}"),
        other => panic!("second EAL init with other arguments: {other:?}"),
    }
    // One DpdkPort per ethdev; a port that does not exist says how to get one.
    assert!(matches!(dpdk::open(&eal_args, DpdkOptions::default()), Err(PortError::Misuse(_))));
    assert_eq!(dpdk::port_by_name("net_af_packet0").unwrap(), 0);
    assert!(matches!(dpdk::port_by_name("net_nothing9"), Err(PortError::Unavailable { .. })));
    let missing = DpdkOptions { port_id: 7, ..DpdkOptions::default() };
    match dpdk::open(&eal_args, missing) {
        Err(PortError::Unavailable { why, .. }) => assert!(why.contains("--vdev"), "{why}"),
        other => panic!("port 7: {other:?}"),
    }

    let raw = pair.b.netns.run({
        let ifname = pair.b.ifname.clone();
        move || raw_socket(&ifname, LANBUS)
    });
    let raw = raw.unwrap().unwrap();
    let mut buf = vec![0u8; 2048];

    // a -> b: the DPDK port transmits, the raw socket checks every frame in order.
    let mut next_tx = 0u32;
    let mut next_rx = 0u32;
    while next_rx < FRAMES {
        let window_end = (next_rx + WINDOW).min(FRAMES);
        let deadline = Instant::now() + Duration::from_secs(5);
        while next_tx < window_end {
            let sent = port
                .tx_burst((window_end - next_tx) as usize, &mut |out: &mut [u8]| {
                    if next_tx >= window_end {
                        return None;
                    }
                    let f = frame(b_mac, a_mac, 1, next_tx);
                    out[..f.len()].copy_from_slice(&f);
                    next_tx += 1;
                    Some(f.len())
                })
                .unwrap();
            if sent == 0 {
                assert!(Instant::now() < deadline, "dpdk tx stalled at frame {next_tx}");
                port.wait(Some(Duration::from_micros(100))).unwrap();
            }
        }
        while next_rx < window_end {
            let n = raw_recv(&raw, &mut buf);
            assert_eq!(&buf[..n], &frame(b_mac, a_mac, 1, next_rx)[..], "a->b frame {next_rx}");
            next_rx += 1;
        }
    }
    assert_eq!(port.tx_backlog(), 0);

    // A frame of another EtherType reaches the vdev but not the caller: counted as dropped.
    let other = pair.b.netns.run({
        let ifname = pair.b.ifname.clone();
        move || raw_socket(&ifname, 0x88B6)
    });
    let other = other.unwrap().unwrap();
    let mut not_lanbus = frame(a_mac, b_mac, 3, 0);
    not_lanbus[12..14].copy_from_slice(&0x88B6u16.to_be_bytes());
    raw_send(&other, &not_lanbus);

    // b -> a: the raw socket transmits, the DPDK port checks every frame in order.
    let mut next_tx = 0u32;
    let mut next_rx = 0u32;
    while next_rx < FRAMES {
        let window_end = (next_rx + WINDOW).min(FRAMES);
        while next_tx < window_end {
            raw_send(&raw, &frame(a_mac, b_mac, 2, next_tx));
            next_tx += 1;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while next_rx < window_end {
            let got = port
                .rx_burst(32, &mut |f: &[u8]| {
                    assert_eq!(f, &frame(a_mac, b_mac, 2, next_rx)[..], "b->a frame {next_rx}");
                    next_rx += 1;
                })
                .unwrap();
            if got == 0 {
                assert!(Instant::now() < deadline, "dpdk rx stalled at frame {next_rx}");
                port.wait(Some(Duration::from_millis(1))).unwrap();
            }
        }
    }
    // wait(): returns at its timeout when idle, and soon after a frame arrives, which the next
    // rx_burst then delivers (wait polls the queue; it must not lose what it finds).
    let t0 = Instant::now();
    port.wait(Some(Duration::from_millis(30))).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(1), "idle wait overran: {:?}", t0.elapsed());
    // A frame sent 50 ms into a wait, from another thread.
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        raw_send(&raw, &frame(a_mac, b_mac, 2, FRAMES));
        (raw, Instant::now())
    });
    let t0 = Instant::now();
    let mut got = 0;
    while got == 0 {
        port.wait(Some(Duration::from_secs(2))).unwrap();
        got += port.rx_burst(32, &mut |f: &[u8]| assert_eq!(f, &frame(a_mac, b_mac, 2, FRAMES)[..])).unwrap();
        assert!(t0.elapsed() < Duration::from_secs(2), "wait missed the frame");
    }
    let (raw, sent_at) = sender.join().unwrap();
    let late = sent_at.elapsed();
    eprintln!("wait: the frame sent during it was delivered {late:?} after it was sent");
    assert!(late < Duration::from_millis(500), "wait slept through a frame for {late:?}");
    drop(raw);

    // Nothing more is delivered: no duplicates, no echo of our own transmissions.
    let settle = Instant::now() + Duration::from_millis(50);
    while Instant::now() < settle {
        assert_eq!(port.rx_burst(32, &mut |f: &[u8]| panic!("unexpected frame {f:02x?}")).unwrap(), 0);
        port.wait(Some(Duration::from_millis(5))).unwrap();
    }

    let c = port.counters();
    let stats = port.device_stats().unwrap();
    eprintln!("counters {c:?}\ndevice {stats:?}\nelapsed {:?}", started.elapsed());
    assert_eq!(c.tx_frames, u64::from(FRAMES));
    assert_eq!(c.rx_frames, u64::from(FRAMES) + 1);
    assert!(c.rx_dropped >= 1, "the 0x88B6 frame is counted as dropped: {c:?}");
    assert_eq!(c.tx_dropped, 0);
    assert!(stats.opackets >= u64::from(FRAMES), "{stats:?}");
    assert!(stats.ipackets > u64::from(FRAMES), "lanbus frames plus the 0x88B6 one: {stats:?}");

    // The ring (1024 entries) fills before the mempool runs out: refused frames wait in the backlog.
    let largest_backlog = ring_loopback_backpressure(&eal_args, "net_ring0", 2047, false);
    assert!(largest_backlog > 0);
    // The mempool (600 mbufs) runs out before the ring fills: the port stops taking frames. (Also
    // promiscuous mode, and an MTU option equal to the device's.)
    let largest_backlog = ring_loopback_backpressure(&eal_args, "net_ring1", 600, true);
    assert_eq!(largest_backlog, 0);

    // Closing releases the vdev for good: it cannot be opened again in this process.
    drop(port);
    match dpdk::open(&eal_args, DpdkOptions::default()) {
        Err(PortError::Unavailable { why, .. }) => assert!(why.contains("closed"), "{why}"),
        other => panic!("reopening a closed vdev: {other:?}"),
    }
}

/// DPDK's `net_ring` vdev is a loopback (transmit enqueues into the ring receive reads): it fills
/// up, so it shows the port's back-pressure. The caller offers far more frames than fit; the port
/// takes what it can (keeping the device's refusals in its backlog or stopping when the mempool
/// is empty) and every frame it took comes back once, in order, intact. Returns the largest
/// backlog seen.
fn ring_loopback_backpressure(eal_args: &str, vdev: &str, mbufs: u32, promiscuous: bool) -> usize {
    const TOTAL: u32 = 5000;
    let port_id = dpdk::port_by_name(vdev).unwrap();
    let mtu = promiscuous.then_some(1500);
    let options = DpdkOptions { port_id, mbufs, promiscuous, mtu, ..DpdkOptions::default() };
    let mut port = dpdk::open(eal_args, options).unwrap();
    assert_eq!(port.driver(), "net_ring");
    let (me, peer) = (port.mac(), MacAddr::local(7));
    // Malformed and foreign frames on the loopback: a runt and an IPv4 frame are counted and
    // dropped, the lanbus frame after them delivered.
    let mut ipv4 = frame(peer, me, 5, 0);
    ipv4[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let good = frame(peer, me, 5, 1);
    assert_eq!(port.send_frames(&[&ipv4[..10], &ipv4, &good]).unwrap(), 3);
    let mut seen = Vec::new();
    while seen.is_empty() {
        port.rx_burst(32, &mut |f: &[u8]| seen.push(f.to_vec())).unwrap();
    }
    assert_eq!(seen, [good]);
    assert_eq!(port.counters().rx_dropped, 2);

    let (mut next_tx, mut next_rx) = (0u32, 0u32);
    let mut stalls = 0;
    let mut max_backlog = 0;
    while next_rx < TOTAL {
        // Offer everything that is left in one call, then keep offering until the port refuses.
        loop {
            let before = next_tx;
            let taken = port
                .tx_burst((TOTAL - next_tx) as usize, &mut |out: &mut [u8]| {
                    if next_tx >= TOTAL {
                        return None;
                    }
                    let f = frame(peer, me, 4, next_tx);
                    out[..f.len()].copy_from_slice(&f);
                    next_tx += 1;
                    Some(f.len())
                })
                .unwrap();
            assert_eq!(taken as u32, next_tx - before, "tx_burst counts every frame it took");
            max_backlog = max_backlog.max(port.tx_backlog());
            if taken == 0 || next_tx == TOTAL {
                break;
            }
        }
        if next_tx < TOTAL {
            stalls += 1;
        }
        let before = next_rx;
        loop {
            let got = port
                .rx_burst(64, &mut |f: &[u8]| {
                    assert_eq!(f, &frame(peer, me, 4, next_rx)[..], "ring frame {next_rx}");
                    next_rx += 1;
                })
                .unwrap();
            if got == 0 {
                break;
            }
        }
        assert!(next_rx > before || next_tx == TOTAL, "no progress at {next_rx}");
        assert!(next_rx <= next_tx);
    }
    let c = port.counters();
    eprintln!("{vdev} loopback, {mbufs} mbufs: {stalls} stalls, largest backlog {max_backlog}, {c:?}");
    assert!(stalls > 0, "the ring never filled: the test did not exercise back-pressure");
    assert_eq!((c.tx_frames, c.rx_frames), (u64::from(TOTAL) + 3, u64::from(TOTAL) + 1));
    assert_eq!((c.rx_dropped, c.tx_dropped), (2, 0));
    max_backlog
}
