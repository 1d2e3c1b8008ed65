//! Two processes over memfd + SCM_RIGHTS: frames both ways through two pipes with eventfd
//! doorbells, and a peer that scribbles garbage indices gets the other side an error, not a crash.
//!
//! The child is this same test binary, re-executed with `LANBUS_RING_CHILD=<role>:<socket path>`
//! and asked to run only `child_entry`, which does nothing in a normal run.
#![cfg(not(loom))]

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanbus_ring::pipe::{PipeConfig, Receiver, Sender};
use lanbus_ring::spsc::{self, layout};
use lanbus_ring::{recv_fds, send_fds, Consumer, CopyMode, Error, EventFd, Producer, Region};

const CFG: PipeConfig = PipeConfig { slots: 64, buffers: 96, buf_size: 1536 };
const FRAMES: u32 = 2000;

fn pipe_offset(k: usize) -> usize {
    k * CFG.bytes_needed().next_multiple_of(64)
}
fn ring_offset() -> usize {
    pipe_offset(2)
}
fn region_len() -> usize {
    ring_offset() + spsc::bytes_needed::<u64>(32)
}

fn frame(i: u32) -> Vec<u8> {
    (0..(i * 37) % 1400 + 14).map(|b| (b as u8).wrapping_mul(3) ^ (i as u8)).collect()
}

/// Spawns the child role and accepts its connection.
fn spawn_child(role: &str) -> (Child, UnixStream, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("lanbus-ring-test-{}-{role}", std::process::id()));
    let _ = std::fs::remove_file(&dir);
    let listener = UnixListener::bind(&dir).unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("LANBUS_RING_CHILD", format!("{role}:{}", dir.display()))
        .spawn()
        .unwrap();
    let (sock, _) = listener.accept().unwrap();
    (child, sock, dir)
}

/// Creates the shared memory, formats two pipes and a ring, sends memfd + two eventfds.
fn share(sock: &UnixStream) -> (Arc<Region>, EventFd, EventFd) {
    let region = Arc::new(Region::memfd("lanbus-test", region_len()).unwrap());
    CFG.format(&region, pipe_offset(0)).unwrap();
    CFG.format(&region, pipe_offset(1)).unwrap();
    spsc::format::<u64>(&region, ring_offset(), 32).unwrap();
    let to_child = EventFd::new().unwrap();
    let to_parent = EventFd::new().unwrap();
    use std::os::fd::AsFd;
    send_fds(sock, b"hello", &[region.fd().unwrap(), to_child.as_fd(), to_parent.as_fd()]).unwrap();
    (region, to_child, to_parent)
}

fn wait_rx(rx: &mut Receiver, bell: &EventFd) {
    rx.prepare_wait();
    if !rx.has_pending() {
        bell.wait(Some(Duration::from_millis(100))).unwrap();
    }
    rx.finish_wait();
}

#[test]
fn frames_cross_processes_both_ways() {
    let (mut child, sock, path) = spawn_child("echo");
    let (region, to_child, to_parent) = share(&sock);
    let mut tx = Sender::attach(region.clone(), pipe_offset(0), CopyMode::NonTemporal).unwrap();
    let mut rx = Receiver::attach(region.clone(), pipe_offset(1)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let (mut sent, mut got) = (0u32, 0u32);
    while got < FRAMES {
        assert!(Instant::now() < deadline, "timed out: sent {sent}, echoed back {got}");
        while sent < FRAMES && tx.send(&frame(sent)).unwrap() {
            sent += 1;
        }
        if tx.wake_needed() {
            to_child.notify().unwrap();
        }
        let mut any = false;
        while rx
            .recv(|f| {
                let mut want = frame(got);
                want.reverse();
                assert_eq!(f, &want[..], "echo of frame {got}");
            })
            .unwrap()
        {
            got += 1;
            any = true;
        }
        if !any && sent == FRAMES {
            wait_rx(&mut rx, &to_parent);
        }
    }
    assert!(child.wait().unwrap().success());
    let _ = std::fs::remove_file(path);
}

#[test]
fn peer_garbage_gives_errors() {
    let (mut child, mut sock, path) = spawn_child("scribble");
    let (region, _to_child, _to_parent) = share(&sock);
    let mut consumer = Consumer::<u64>::attach(region.clone(), ring_offset()).unwrap();
    let mut tx = Sender::attach(region.clone(), pipe_offset(0), CopyMode::Ordinary).unwrap();
    let mut rx = Receiver::attach(region.clone(), pipe_offset(1)).unwrap();
    assert!(tx.send(b"a frame").unwrap());
    // Tell the child to scribble, and wait until it has.
    sock.write_all(b"go").unwrap();
    let mut done = [0u8; 4];
    sock.read_exact(&mut done).unwrap();
    assert_eq!(&done, b"done");
    assert!(child.wait().unwrap().success());
    let mut out = [0u64; 8];
    assert!(matches!(consumer.dequeue_burst(&mut out), Err(Error::Corrupt(_))));
    assert!(matches!(rx.recv(|_| panic!("garbage delivered")), Err(Error::Corrupt(_))));
    assert!(matches!(tx.reclaim(), Err(Error::Corrupt(_))));
    let _ = std::fs::remove_file(path);
}

fn child_echo(sock: UnixStream) {
    let mut buf = [0u8; 16];
    let (_, fds) = recv_fds(&sock, &mut buf).unwrap();
    let mut fds = fds.into_iter();
    let region = Arc::new(Region::from_fd(fds.next().unwrap()).unwrap());
    let from_parent = EventFd::from_fd(fds.next().unwrap());
    let to_parent = EventFd::from_fd(fds.next().unwrap());
    let mut rx = Receiver::attach(region.clone(), pipe_offset(0)).unwrap();
    let mut tx = Sender::attach(region, pipe_offset(1), CopyMode::Ordinary).unwrap();
    let mut pending: std::collections::VecDeque<Vec<u8>> = Default::default();
    let mut echoed = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while echoed < FRAMES {
        assert!(Instant::now() < deadline, "child timed out");
        while rx
            .recv(|f| {
                let mut v = f.to_vec();
                v.reverse();
                pending.push_back(v);
            })
            .unwrap()
        {}
        while let Some(f) = pending.front() {
            if !tx.send(f).unwrap() {
                break;
            }
            pending.pop_front();
            echoed += 1;
        }
        if tx.wake_needed() {
            to_parent.notify().unwrap();
        }
        if pending.is_empty() {
            wait_rx(&mut rx, &from_parent);
        } else {
            std::thread::yield_now();
        }
    }
}

fn child_scribble(mut sock: UnixStream) {
    let mut buf = [0u8; 16];
    let (_, fds) = recv_fds(&sock, &mut buf).unwrap();
    let region = Region::from_fd(fds.into_iter().next().unwrap()).unwrap();
    let mut go = [0u8; 2];
    sock.read_exact(&mut go).unwrap();
    let base = region.as_ptr();
    // SAFETY: every write below is an aligned u32 inside the mapped region: this process plays a
    // faulty peer on purpose.
    unsafe {
        // The ring: the producer index claims 10_000 elements in a 32-slot ring.
        base.add(ring_offset() + layout::TAIL).cast::<u32>().write_volatile(10_000);
        // Pipe 0 (parent sends): descriptor 0 marked used, naming a buffer that was never sent.
        let d0 = base.add(pipe_offset(0) + 192);
        d0.cast::<u32>().write_volatile(77);
        d0.add(12).cast::<u32>().write_volatile(0x8080_0000);
        // Pipe 1 (parent receives): descriptor 0 made available, naming a buffer outside the pool.
        let d1 = base.add(pipe_offset(1) + 192);
        d1.cast::<u32>().write_volatile(0xFFFF_FFF0);
        d1.add(8).cast::<u32>().write_volatile(64);
        d1.add(12).cast::<u32>().write_volatile(0x0080_0000);
    }
    sock.write_all(b"done").unwrap();
}

/// The child's entry point: does nothing unless this process was spawned as a child.
#[test]
fn child_entry() {
    let Ok(spec) = std::env::var("LANBUS_RING_CHILD") else { return };
    let (role, path) = spec.split_once(':').unwrap();
    let sock = UnixStream::connect(path).unwrap();
    match role {
        "echo" => child_echo(sock),
        "scribble" => child_scribble(sock),
        other => panic!("unknown child role {other}"),
    }
}

#[test]
fn producer_side_attach_in_child_layout_is_valid() {
    // The layout helpers agree with the pipes' real sizes (guards the offsets the child uses).
    let region = Region::anonymous(region_len()).unwrap();
    CFG.format(&region, pipe_offset(0)).unwrap();
    CFG.format(&region, pipe_offset(1)).unwrap();
    spsc::format::<u64>(&region, ring_offset(), 32).unwrap();
    let region = Arc::new(region);
    assert!(Producer::<u64>::attach(region.clone(), ring_offset()).is_ok());
    assert!(Sender::attach(region, pipe_offset(1), CopyMode::Ordinary).is_ok());
}
