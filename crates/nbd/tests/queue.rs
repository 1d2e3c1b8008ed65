//! A device with queues of its own (`BlockDevice::queue`): one thread serves all of a
//! connection's requests, which finish in any order, wait when the queue is full, and fall back
//! to the plain calls when the queue does not take them; nothing is lost when the client
//! disconnects, leaves with requests in flight, or sends a request in pieces. Half the writes
//! the queue takes hold their payload until they finish and a while after: the server never
//! reuses a buffer the queue still holds.

mod common;

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use lanbus_block::{BlockDevice, BlockQueue, DeviceError, MemDevice, Reaped};
use lanbus_nbd::proto::*;
use lanbus_nbd::{Client, Errno, Export, Stream};
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Bytes of the region whose reads and writes the queue fails.
const BAD: std::ops::Range<u64> = (7 << 20)..(7 << 20) + 4096;

/// A RAM device that hands out up to `queues` queues, each taking requests of up to 64 KiB
/// with room for `room` at once, finishing them in a seeded random order a few at a time.
struct QueuedMem {
    mem: MemDevice,
    queues: AtomicUsize,
    room: usize,
    /// Most requests any queue held at once, and requests the queues finished.
    most_in_flight: AtomicUsize,
    finished: AtomicU64,
    /// Queues dropped with requests still in flight (must stay 0).
    dropped_busy: AtomicUsize,
    seed: AtomicU64,
    /// What the queues say of writes taken in pieces (`BlockQueue::write_piece_bytes`).
    write_piece: Option<usize>,
    /// Writes the queues took, and the largest.
    writes: AtomicUsize,
    largest_write: AtomicUsize,
    /// Whether the queues take writes whose payload the server reads straight into their
    /// memory (`BlockQueue::submit_write_filled`), and how many they took so.
    fill: bool,
    filled: AtomicUsize,
    /// Whether the queues ask `fill` for more bytes than a write's payload (a broken queue).
    greedy: bool,
}

impl QueuedMem {
    fn new(size: u64, queues: usize, room: usize) -> QueuedMem {
        QueuedMem {
            mem: MemDevice::new(size),
            queues: AtomicUsize::new(queues),
            room,
            most_in_flight: AtomicUsize::new(0),
            finished: AtomicU64::new(0),
            dropped_busy: AtomicUsize::new(0),
            seed: AtomicU64::new(1),
            write_piece: None,
            writes: AtomicUsize::new(0),
            largest_write: AtomicUsize::new(0),
            fill: false,
            filled: AtomicUsize::new(0),
            greedy: false,
        }
    }
}

enum Op {
    Read {
        offset: u64,
        len: usize,
    },
    Write {
        offset: u64,
        data: Vec<u8>,
    },
    /// A write whose payload the queue holds rather than copies, read only when it finishes.
    Shared {
        offset: u64,
        data: Arc<Vec<u8>>,
    },
}

struct MemQueue<'a> {
    dev: &'a QueuedMem,
    rng: ChaCha8Rng,
    submitted: Vec<(u64, Op)>,
    started: Vec<(u64, Op)>,
    /// Shared payloads still held a while after their writes finished (as a thread that sends
    /// them may hold them after the device has them).
    lingering: VecDeque<Arc<Vec<u8>>>,
}

impl BlockQueue for MemQueue<'_> {
    fn max_request_bytes(&self) -> usize {
        64 << 10
    }
    fn in_flight(&self) -> usize {
        self.submitted.len() + self.started.len()
    }
    fn submit_read(&mut self, tag: u64, offset: u64, len: usize) -> Result<bool, DeviceError> {
        self.submit(tag, Op::Read { offset, len })
    }
    fn submit_write(&mut self, tag: u64, offset: u64, data: &[u8], _fua: bool) -> Result<bool, DeviceError> {
        self.submit(tag, Op::Write { offset, data: data.to_vec() })
    }
    fn submit_write_shared(
        &mut self,
        tag: u64,
        offset: u64,
        data: &Arc<Vec<u8>>,
        fua: bool,
    ) -> Result<bool, DeviceError> {
        // Every other tag copies, so both kinds of buffer are in use at once.
        if tag.is_multiple_of(2) {
            return self.submit_write(tag, offset, data, fua);
        }
        self.submit(tag, Op::Shared { offset, data: Arc::clone(data) })
    }
    fn submit_write_filled(
        &mut self,
        tag: u64,
        offset: u64,
        len: usize,
        _fua: bool,
        fill: &mut dyn FnMut(&mut [&mut [u8]]) -> bool,
    ) -> Option<Result<bool, DeviceError>> {
        if !self.dev.fill {
            return None;
        }
        if self.in_flight() >= self.dev.room {
            return Some(Ok(false));
        }
        let failed = || DeviceError::Failed("bad block".into());
        // A write at the bad block fails before its payload is asked for; one that ends in it
        // fails after its first part is in (the server reads and drops the rest).
        if BAD.contains(&offset) {
            return Some(Err(failed()));
        }
        if self.dev.greedy {
            let mut more = vec![0u8; len + 512];
            return Some(match fill(&mut [&mut more[..]]) {
                true => self.submit(tag, Op::Write { offset, data: more }),
                false => Err(failed()),
            });
        }
        let mut data = vec![0u8; len];
        let (first, second) = data.split_at_mut(len / 2);
        // Slices of odd sizes, as pages of a device's memory might be.
        let mut slices: Vec<&mut [u8]> = first.chunks_mut(3000).collect();
        if !fill(&mut slices) {
            return Some(Err(failed()));
        }
        if offset + len as u64 > BAD.start && offset < BAD.end {
            return Some(Err(failed()));
        }
        let mut slices: Vec<&mut [u8]> = second.chunks_mut(5000).collect();
        if !fill(&mut slices) {
            return Some(Err(failed()));
        }
        self.dev.filled.fetch_add(1, Ordering::Relaxed);
        Some(self.submit(tag, Op::Write { offset, data }))
    }
    fn write_piece_bytes(&self) -> Option<usize> {
        self.dev.write_piece
    }
    fn start(&mut self) -> Result<(), DeviceError> {
        self.started.append(&mut self.submitted);
        Ok(())
    }
    fn reap(&mut self, done: &mut dyn FnMut(u64, Reaped<'_>)) -> Result<usize, DeviceError> {
        // Only started requests finish, a few at a time, in any order.
        let n = self.rng.random_range(0..=3).min(self.started.len());
        for _ in 0..n {
            let i = self.rng.random_range(0..self.started.len());
            let (tag, op) = self.started.swap_remove(i);
            let bad = |offset: u64| BAD.contains(&offset);
            match op {
                Op::Read { offset, .. } | Op::Write { offset, .. } | Op::Shared { offset, .. }
                    if bad(offset) =>
                {
                    done(tag, Err(DeviceError::Failed("bad block".into())))
                }
                Op::Read { offset, len } => {
                    let mut buf = vec![0u8; len];
                    self.dev.mem.read_at(offset, &mut buf).unwrap();
                    // Lent in odd pieces, as a device's DMA buffers might be.
                    let pieces: Vec<&[u8]> = buf.chunks(3000).collect();
                    done(tag, Ok(&pieces));
                }
                Op::Write { offset, data } => {
                    self.dev.mem.write_at(offset, &data, false).unwrap();
                    done(tag, Ok(&[]));
                }
                Op::Shared { offset, data } => {
                    self.dev.mem.write_at(offset, &data, false).unwrap();
                    done(tag, Ok(&[]));
                    self.lingering.push_back(data);
                    if self.lingering.len() > 3 {
                        self.lingering.pop_front();
                    }
                }
            }
            self.dev.finished.fetch_add(1, Ordering::Relaxed);
        }
        Ok(n)
    }
    fn wait(&mut self, _timeout: Duration) {
        if !self.started.is_empty() {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl MemQueue<'_> {
    fn submit(&mut self, tag: u64, op: Op) -> Result<bool, DeviceError> {
        if self.in_flight() >= self.dev.room {
            return Ok(false);
        }
        assert!(
            !self.submitted.iter().chain(&self.started).any(|(t, _)| *t == tag),
            "tag {tag} submitted twice"
        );
        if let Op::Write { data, .. } = &op {
            self.dev.note_write(data.len());
        } else if let Op::Shared { data, .. } = &op {
            self.dev.note_write(data.len());
        }
        self.submitted.push((tag, op));
        self.dev.most_in_flight.fetch_max(self.in_flight(), Ordering::Relaxed);
        Ok(true)
    }
}

impl QueuedMem {
    fn note_write(&self, len: usize) {
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.largest_write.fetch_max(len, Ordering::Relaxed);
    }
}

impl Drop for MemQueue<'_> {
    fn drop(&mut self) {
        if self.in_flight() > 0 {
            self.dev.dropped_busy.fetch_add(1, Ordering::Relaxed);
        }
        self.dev.queues.fetch_add(1, Ordering::Relaxed);
    }
}

impl BlockDevice for QueuedMem {
    fn size_bytes(&self) -> u64 {
        self.mem.size_bytes()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        self.mem.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        self.mem.write_at(offset, data, fua)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        self.mem.flush()
    }
    fn queue(&self) -> Option<Box<dyn BlockQueue + '_>> {
        self.queues.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).ok()?;
        let seed = self.seed.fetch_add(1, Ordering::Relaxed);
        Some(Box::new(MemQueue {
            dev: self,
            rng: ChaCha8Rng::seed_from_u64(seed),
            submitted: Vec::new(),
            started: Vec::new(),
            lingering: VecDeque::new(),
        }))
    }
}

fn start(dev: &Arc<QueuedMem>, tag: &str) -> TestServer {
    TestServer::start(tag, vec![Export::new("export", dev.clone() as Arc<dyn BlockDevice>)])
}

/// Runs `f` on a thread of its own and fails the test if it takes more than 60 seconds (a
/// request the server lost would otherwise hang it).
fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(60)).expect("the client got every reply in time")
}

#[test]
fn requests_on_queues_and_plain_ones_match_a_model() {
    const CONNS: u64 = 4;
    const REGION: u64 = 1 << 20;
    // Two queues for four connections: two are served by the queue, two by workers.
    let dev = Arc::new(QueuedMem::new(8 << 20, 2, 6));
    let srv = start(&dev, "queue-model");
    let socket = srv.socket.clone();
    let models = bounded(move || {
        let threads: Vec<_> = (0..CONNS)
            .map(|i| {
                let socket = socket.clone();
                std::thread::spawn(move || {
                    let mut rng = ChaCha8Rng::seed_from_u64(100 + i);
                    let mut c = Client::connect_unix(&socket, "export").unwrap();
                    let base = REGION * i;
                    let mut model = vec![0u8; REGION as usize];
                    for round in 0..6 {
                        // Writes to disjoint 128 KiB blocks, some larger than the queue takes.
                        let mut blocks: Vec<u64> = (0..REGION / (128 << 10)).collect();
                        for k in (1..blocks.len()).rev() {
                            blocks.swap(k, rng.random_range(0..=k));
                        }
                        for &b in &blocks {
                            let len = 512 * rng.random_range(1..=256usize);
                            let mut data = vec![0u8; len];
                            rng.fill_bytes(&mut data);
                            let off = b * (128 << 10);
                            model[off as usize..off as usize + len].copy_from_slice(&data);
                            c.submit(Command::Write, 0, base + off, len as u32, &data).unwrap();
                        }
                        if round % 2 == 1 {
                            // A flush among writes in flight waits for nothing and breaks nothing.
                            c.submit(Command::Flush, 0, 0, 0, &[]).unwrap();
                        }
                        while c.in_flight() > 0 {
                            assert_eq!(c.complete().unwrap().error, 0);
                        }
                        reads_match_model(&mut c, &mut rng, base, &model, 24, 200);
                    }
                    c.disconnect().unwrap();
                    model
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect::<Vec<_>>()
    });
    for (i, model) in models.into_iter().enumerate() {
        assert!(read_all(&*dev, REGION * i as u64, REGION as usize) == model, "connection {i}'s region");
    }
    wait_for("connections to close", || srv.server.stats().connections_active == 0);
    let most = dev.most_in_flight.load(Ordering::Relaxed);
    assert!(most > 1 && most <= 6, "the queues held several requests, never more than their room: {most}");
    assert!(dev.finished.load(Ordering::Relaxed) > 0);
    assert_eq!(dev.dropped_busy.load(Ordering::Relaxed), 0, "every queue ended empty");
    assert_eq!(dev.queues.load(Ordering::Relaxed), 2, "every queue went back");
    let s = srv.server.stats();
    assert_eq!(s.requests_write, CONNS * 6 * 8);
    assert_eq!(s.requests_read, CONNS * 6 * 24);
    assert_eq!(s.protocol_disconnects + s.device_errors + s.requests_refused, 0, "{s:?}");
}

#[test]
fn writes_read_straight_into_the_queue_match_a_model() {
    const REGION: u64 = 2 << 20;
    // Room for two: a write often finds the queue full.
    let mut dev = QueuedMem::new(8 << 20, 1, 2);
    dev.fill = true;
    let dev = Arc::new(dev);
    let srv = start(&dev, "queue-fill");
    let socket = srv.socket.clone();
    let (model, small) = bounded(move || {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut c = Client::connect_unix(&socket, "export").unwrap();
        let mut model = vec![0u8; REGION as usize];
        let mut small = 0;
        for round in 0..6 {
            // Writes to disjoint 128 KiB blocks, from one block to 128 KiB (beyond what the
            // queue takes), reads among them; two a
            // round the queue fails, one before and one after it asked for part of the
            // payload: their answers are errors, and the requests behind them stand.
            let mut want = HashMap::new();
            for b in 0..REGION / (128 << 10) {
                let len = 512 * rng.random_range(1..=256usize);
                small += usize::from(len <= 64 << 10);
                let mut data = vec![0u8; len];
                rng.fill_bytes(&mut data);
                let off = b * (128 << 10);
                model[off as usize..off as usize + len].copy_from_slice(&data);
                want.insert(c.submit(Command::Write, 0, off, len as u32, &data).unwrap(), 0);
                if b == round {
                    for at in [BAD.start, BAD.start - 8192] {
                        let h = c.submit(Command::Write, 0, at, 16384, &[3; 16384]).unwrap();
                        want.insert(h, Errno::Io.as_u32());
                    }
                }
                let at = 512 * rng.random_range(0..(REGION - 4096) / 512);
                want.insert(c.submit(Command::Read, 0, (4 << 20) + at, 4096, &[]).unwrap(), 0);
            }
            while c.in_flight() > 0 {
                let d = c.complete().unwrap();
                assert_eq!(want.remove(&d.handle), Some(d.error), "one answer for handle {}", d.handle);
            }
            assert!(want.is_empty());
            reads_match_model(&mut c, &mut rng, 0, &model, 16, 256);
        }
        c.disconnect().unwrap();
        (model, small)
    });
    wait_for("the connection to close", || srv.server.stats().connections_active == 0);
    assert!(read_all(&*dev, 0, REGION as usize) == model);
    // Every write the queue takes (up to 64 KiB) was read straight into it, a full queue
    // waited for; the longer ones went the plain way.
    assert!(small > 6 * 16 / 4);
    assert_eq!(dev.filled.load(Ordering::Relaxed), small, "writes read straight into the queue");
    assert_eq!(dev.dropped_busy.load(Ordering::Relaxed), 0, "every queue ended empty");
    let s = srv.server.stats();
    assert_eq!(s.requests_write, 6 * 18);
    assert_eq!((s.device_errors, s.protocol_disconnects), (12, 0), "{s:?}");
}

#[test]
fn a_queue_that_asks_for_more_than_a_payload_gets_none_of_the_next_request() {
    let mut dev = QueuedMem::new(8 << 20, 1, 2);
    (dev.fill, dev.greedy) = (true, true);
    let dev = Arc::new(dev);
    let srv = start(&dev, "queue-greedy");
    let socket = srv.socket.clone();
    bounded(move || {
        // The write's payload and the read's header right behind it: the server does not read
        // the header as payload, and ends the connection rather than go on out of step.
        let mut c = Client::connect_unix(&socket, "export").unwrap();
        c.submit(Command::Write, 0, 0, 4096, &[5; 4096]).unwrap();
        c.submit(Command::Read, 0, 0, 4096, &[]).unwrap();
        assert!(c.complete().is_err(), "the connection ended");
    });
    wait_for("the connection to close", || srv.server.stats().connections_active == 0);
    assert_eq!(dev.writes.load(Ordering::Relaxed), 0, "nothing was written");
    assert!(read_all(&*dev, 0, 4096) == vec![0; 4096]);
}

#[test]
fn writes_longer_than_a_piece_go_in_pieces_and_are_answered_once() {
    const REGION: u64 = 2 << 20;
    const PIECE: usize = 16 << 10;
    // Room for four pieces: a long write waits for room in the middle of its payload.
    let mut dev = QueuedMem::new(8 << 20, 1, 4);
    dev.write_piece = Some(PIECE);
    let dev = Arc::new(dev);
    let srv = start(&dev, "queue-stream");
    let socket = srv.socket.clone();
    let (model, long) = bounded(move || {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut c = Client::connect_unix(&socket, "export").unwrap();
        let mut model = vec![0u8; REGION as usize];
        let mut long = 0;
        for round in 0..8 {
            // Writes to disjoint 256 KiB blocks, from one block to 256 KiB (beyond what the
            // queue takes whole), with reads among them; one write a round whose second piece
            // fails: its answer is an error, and its payload is still read to its end.
            let mut want = HashMap::new();
            for b in 0..REGION / (256 << 10) {
                let len = 512 * rng.random_range(1..=512usize);
                long += usize::from(len > PIECE);
                let mut data = vec![0u8; len];
                rng.fill_bytes(&mut data);
                let off = b * (256 << 10);
                model[off as usize..off as usize + len].copy_from_slice(&data);
                want.insert(c.submit(Command::Write, 0, off, len as u32, &data).unwrap(), 0);
                if b == round {
                    let h = c
                        .submit(Command::Write, 0, BAD.start - PIECE as u64, 64 << 10, &[3; 64 << 10])
                        .unwrap();
                    want.insert(h, Errno::Io.as_u32());
                }
                let at = 512 * rng.random_range(0..(REGION - 4096) / 512);
                let h = c.submit(Command::Read, 0, (4 << 20) + at, 4096, &[]).unwrap();
                want.insert(h, 0);
            }
            while c.in_flight() > 0 {
                let d = c.complete().unwrap();
                assert_eq!(want.remove(&d.handle), Some(d.error), "one answer for handle {}", d.handle);
            }
            assert!(want.is_empty());
            reads_match_model(&mut c, &mut rng, 0, &model, 16, 512);
        }
        c.disconnect().unwrap();
        (model, long)
    });
    wait_for("the connection to close", || srv.server.stats().connections_active == 0);
    assert!(read_all(&*dev, 0, REGION as usize) == model);
    assert_eq!(dev.largest_write.load(Ordering::Relaxed), PIECE, "no write went to the queue whole");
    assert!(dev.writes.load(Ordering::Relaxed) > 8 * 8 + long, "long writes went in several pieces");
    assert_eq!(dev.dropped_busy.load(Ordering::Relaxed), 0, "every queue ended empty");
    let s = srv.server.stats();
    assert_eq!(s.requests_write, 8 * 9);
    assert_eq!((s.device_errors, s.protocol_disconnects), (8, 0), "{s:?}");
}

#[test]
fn a_piece_size_of_zero_means_whole_writes() {
    let mut dev = QueuedMem::new(8 << 20, 1, 4);
    dev.write_piece = Some(0);
    let dev = Arc::new(dev);
    let srv = start(&dev, "queue-piece-zero");
    let socket = srv.socket.clone();
    bounded(move || {
        let mut c = Client::connect_unix(&socket, "export").unwrap();
        c.write(0, &[7; 32 << 10], false).unwrap();
        c.disconnect().unwrap();
    });
    wait_for("the connection to close", || srv.server.stats().connections_active == 0);
    assert!(read_all(&*dev, 0, 32 << 10) == vec![7; 32 << 10]);
    assert_eq!(dev.largest_write.load(Ordering::Relaxed), 32 << 10, "the write went whole");
}

#[test]
fn errors_refusals_and_other_commands_keep_their_replies_apart() {
    let dev = Arc::new(QueuedMem::new(8 << 20, 1, 4));
    let srv = start(&dev, "queue-errors");
    let socket = srv.socket.clone();
    bounded(move || {
        let mut c = Client::connect_unix(&socket, "export").unwrap();
        let mut want = HashMap::new();
        c.write(0, &[9; 4096], false).unwrap();
        want.insert(c.submit(Command::Read, 0, BAD.start, 4096, &[]).unwrap(), Errno::Io.as_u32());
        want.insert(c.submit(Command::Write, 0, BAD.start, 512, &[1; 512]).unwrap(), Errno::Io.as_u32());
        // Out of range and misaligned: refused before any queue sees them.
        want.insert(c.submit(Command::Read, 0, 8 << 20, 512, &[]).unwrap(), Errno::Inval.as_u32());
        want.insert(c.submit(Command::Read, 0, 100, 512, &[]).unwrap(), Errno::Inval.as_u32());
        want.insert(c.submit(Command::WriteZeroes, 0, 1 << 20, 8192, &[]).unwrap(), 0);
        want.insert(c.submit(Command::Trim, 0, 2 << 20, 8192, &[]).unwrap(), 0);
        want.insert(c.submit(Command::Read, 0, 4096, 200 << 10, &[]).unwrap(), 0);
        for _ in 0..8 {
            want.insert(c.submit(Command::Read, 0, 0, 4096, &[]).unwrap(), 0);
        }
        while c.in_flight() > 0 {
            let d = c.complete().unwrap();
            assert_eq!(Some(d.error), want.remove(&d.handle), "handle {}", d.handle);
            if d.error == 0 && d.data.len() == 4096 {
                assert!(d.data == vec![9; 4096]);
            }
        }
        assert!(want.is_empty());
        c.disconnect().unwrap();
    });
    wait_for("the connection to close", || srv.server.stats().connections_active == 0);
    let s = srv.server.stats();
    assert_eq!((s.device_errors, s.requests_refused), (2, 2), "{s:?}");
    assert_eq!(dev.dropped_busy.load(Ordering::Relaxed), 0);
}

#[test]
fn writes_before_a_disconnect_or_a_hang_up_are_all_applied() {
    let dev = Arc::new(QueuedMem::new(8 << 20, 1, 8));
    let srv = start(&dev, "queue-leave");
    let socket = srv.socket.clone();
    bounded(move || {
        // NBD_CMD_DISC right behind 32 writes: the server applies and answers every one before
        // it closes (the client reads the replies and then the end of the stream).
        let mut c = Client::connect_unix(&socket, "export").unwrap();
        for i in 0..32u64 {
            c.submit(Command::Write, 0, i * 4096, 4096, &[i as u8 + 1; 4096]).unwrap();
        }
        c.submit(Command::Disc, 0, 0, 0, &[]).unwrap();
        while c.in_flight() > 0 {
            assert_eq!(c.complete().unwrap().error, 0);
        }
        assert!(c.complete().is_err(), "the server closed the connection");
        // A client that hangs up with writes in flight: NBD promises nothing of the writes it
        // got no reply for, but each block is written whole or not at all, and nothing stays
        // in the queue.
        let mut c = Client::connect_unix(&socket, "export").unwrap();
        for i in 32..64u64 {
            c.submit(Command::Write, 0, i * 4096, 4096, &[i as u8 + 1; 4096]).unwrap();
        }
        drop(c);
    });
    wait_for("both connections to close", || srv.server.stats().connections_active == 0);
    for i in 0..64u64 {
        let block = read_all(&*dev, i * 4096, 4096);
        let whole = block == vec![i as u8 + 1; 4096];
        assert!(
            whole || (i >= 32 && block == vec![0; 4096]),
            "block {i} written before the disconnect, or whole: {}",
            block[0]
        );
    }
    assert_eq!(dev.dropped_busy.load(Ordering::Relaxed), 0, "nothing was left in a queue");
}

#[test]
fn a_request_sent_in_pieces_waits_for_its_last_byte() {
    let dev = Arc::new(QueuedMem::new(8 << 20, 1, 8));
    let srv = start(&dev, "queue-pieces");
    let socket = srv.socket.clone();
    bounded(move || {
        let raw = UnixStream::connect(&socket).unwrap();
        let c = Client::handshake(Stream::Unix(raw.try_clone().unwrap()), "export").unwrap();
        drop(c);
        let mut w = raw.try_clone().unwrap();
        let mut r = raw;
        let header = |command, handle, offset: u64, length: u32| {
            RequestHeader { flags: 0, command, handle, offset, length }.emit()
        };
        // A read in flight, then a write whose header and payload come in pieces.
        w.write_all(&header(Command::Read, 1, 0, 4096)).unwrap();
        let mut write = header(Command::Write, 2, 8192, 8192).to_vec();
        write.extend_from_slice(&[0x5A; 8192]);
        let mut pending: VecDeque<&[u8]> = write.chunks(1000).collect();
        while let Some(piece) = pending.pop_front() {
            w.write_all(piece).unwrap();
            std::thread::sleep(Duration::from_millis(2));
        }
        // Both answered: the read with its 4 KiB, the write with its header only.
        let mut got = HashMap::new();
        for _ in 0..2 {
            let mut hb = [0u8; SimpleReply::LEN];
            r.read_exact(&mut hb).unwrap();
            let reply = SimpleReply::parse(&hb).unwrap();
            assert_eq!(reply.error, 0);
            if reply.handle == 1 {
                let mut data = vec![0u8; 4096];
                r.read_exact(&mut data).unwrap();
            }
            got.insert(reply.handle, ());
        }
        assert_eq!(got.len(), 2);
        w.write_all(&header(Command::Disc, 3, 0, 0)).unwrap();
    });
    wait_for("the connection to close", || srv.server.stats().connections_active == 0);
    assert!(read_all(&*dev, 8192, 8192) == vec![0x5A; 8192]);
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}
