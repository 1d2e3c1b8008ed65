//! One thread for all of a connection's requests, on a device queue of the connection's own
//! ([`BlockQueue`]).
//!
//! The worker threads of [`Conn::worker`] run one request each and wait for it. Over a device
//! with deep queues of its own that costs a thread, a wake-up and a poll per request in flight,
//! and at depth 32 the threads spend the machine's cores handing them to each other. Here one
//! thread reads every request the client has sent (one `recv` takes as many as have arrived),
//! submits the reads and writes to the queue and starts them together, then reaps every request
//! that finished and answers it. It waits on the device only while nothing else is to be done,
//! and on the socket only when nothing is in flight (looking without sleeping for a few tens of
//! microseconds first: at depth one the next request follows the reply closely, and a wake-up
//! costs more than the look on these shared cores). A request is taken as soon as its header is
//! in: a write's payload follows it on the wire, and one longer than the inbox would otherwise
//! wait for every request in flight to finish. Where the queue stores writes sooner in pieces
//! ([`BlockQueue::write_piece_bytes`]), a longer write's payload is read a piece at a time and
//! each piece submitted as soon as it is in, so the device works on the first while the rest
//! still arrives; the write is answered once all its pieces are. Where the queue takes a
//! write's data in its own memory ([`BlockQueue::submit_write_filled`]), the payload is read
//! from the socket straight there: no buffer of the connection's and no second copy. Requests
//! the queue does not take (flush, trim, write zeroes, larger than the queue's limit) run the
//! plain way, on this thread, in the order they came.

use std::collections::HashMap;
use std::io::{self, Read};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{bump, reply_header, Conn, ConnError, Ended, ExportLimits, Job, KEEP_BUFFER_BYTES};
use crate::proto::{Action, Errno, RequestHeader};
use lanbus_block::{BlockQueue, DeviceError, Reaped};

/// Longest wait on the device while requests are in flight before the socket is looked at
/// again (a request that arrives meanwhile waits at most this long to be submitted).
const DEVICE_WAIT: Duration = Duration::from_micros(200);

/// The connection's incoming bytes: what the handshake's reader had buffered, then the
/// socket's, read without blocking when asked.
pub(super) struct Inbox {
    fd: RawFd,
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

/// How long a wait for the client looks without sleeping first.
const SOCKET_SPIN: Duration = Duration::from_micros(30);

/// Room for many requests' headers (and small writes) per `recv`.
const INBOX_BYTES: usize = 256 << 10;

/// A read of at least this much into the caller's memory, with nothing buffered, goes straight
/// from the socket (a payload is not copied through the inbox).
const DIRECT_READ_BYTES: usize = 128 << 10;

impl Inbox {
    /// Reads from `fd` (which the caller keeps open for the inbox's life), starting with the
    /// bytes `buffered` already.
    pub(super) fn new(fd: RawFd, buffered: &[u8]) -> Inbox {
        let mut buf = vec![0u8; INBOX_BYTES.max(buffered.len())];
        buf[..buffered.len()].copy_from_slice(buffered);
        Inbox { fd, buf, start: 0, end: buffered.len() }
    }

    fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Receives into the free part of the buffer; without `wait`, only what has arrived.
    /// `Ok(0)`: the client closed; `Err(WouldBlock)`: nothing has arrived.
    fn fill(&mut self, wait: bool) -> io::Result<usize> {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        let n = if wait {
            recv_soon(self.fd, &mut self.buf[self.end..])?
        } else {
            recv(self.fd, &mut self.buf[self.end..], false)?
        };
        self.end += n;
        Ok(n)
    }

    /// The payload length of the next request, once its header is buffered (`None` before,
    /// or when the header is not one: the reader then finds out). A write's payload may still
    /// be on its way: the client sends it right behind the header, and reading it without
    /// waiting for the requests in flight keeps the device busy (a payload longer than the
    /// inbox never is here whole).
    fn next_length(&self) -> Option<u64> {
        let h = RequestHeader::parse(self.buffered().get(..RequestHeader::LEN)?).ok()?;
        Some(u64::from(h.length))
    }
}

/// `recv(2)` of what fits in `buf`, waiting for something to arrive. A client sends its next
/// request (or the rest of a payload) soon after the last: look for it without sleeping for a
/// little while first, which saves the wake-up.
fn recv_soon(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    soon(|wait| recv(fd, buf, wait))
}

/// Calls `recv` without waiting (`false`) until something has arrived or
/// [`SOCKET_SPIN`] has passed, then once waiting (`true`).
fn soon(mut recv: impl FnMut(bool) -> io::Result<usize>) -> io::Result<usize> {
    let until = Instant::now() + SOCKET_SPIN;
    while Instant::now() < until {
        match recv(false) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
            r => return r,
        }
    }
    recv(true)
}

/// Most buffers one `recvmsg(2)` fills (Linux's `UIO_MAXIOV`).
const MAX_IOVECS: usize = 1024;

/// `recvmsg(2)` into `slices` in order, the first from byte `skip` on; without `wait`,
/// `MSG_DONTWAIT`.
#[allow(unsafe_code)] // one recvmsg(2) into the caller's buffers: the standard library has no vectored recv with flags
fn recv_slices(fd: RawFd, slices: &mut [&mut [u8]], skip: usize, wait: bool) -> io::Result<usize> {
    let mut iov: Vec<libc::iovec> = slices
        .iter_mut()
        .take(MAX_IOVECS)
        .enumerate()
        .map(|(i, s)| {
            let s = if i == 0 { &mut s[skip..] } else { &mut s[..] };
            libc::iovec { iov_base: s.as_mut_ptr().cast(), iov_len: s.len() }
        })
        .collect();
    // SAFETY: a zeroed msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len();
    let flags = if wait { 0 } else { libc::MSG_DONTWAIT };
    loop {
        // SAFETY: every iovec names a part of a slice the caller lends mutably for the call;
        // `msg` points at them and at nothing else; `fd` is the connection's socket.
        let n = unsafe { libc::recvmsg(fd, &mut msg, flags) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `recv(2)` of what fits in `buf`; without `wait`, `MSG_DONTWAIT`.
#[allow(unsafe_code)] // one recv(2): the standard library reads without blocking only on a socket set so for good
fn recv(fd: RawFd, buf: &mut [u8], wait: bool) -> io::Result<usize> {
    let flags = if wait { 0 } else { libc::MSG_DONTWAIT };
    loop {
        // SAFETY: `buf` is valid for writes of its length for the call; `fd` is the
        // connection's socket, open for the inbox's life.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

impl Inbox {
    /// Fills every byte of `slices`, in order: what is buffered first, then the rest straight
    /// from the socket when it is large (not through the buffer), else through the buffer.
    /// `Err(UnexpectedEof)` when the client closes first.
    fn read_slices(&mut self, slices: &mut [&mut [u8]]) -> io::Result<()> {
        let (mut i, mut at) = (0, 0);
        loop {
            while i < slices.len() && at == slices[i].len() {
                (i, at) = (i + 1, 0);
            }
            let Some(slice) = slices.get_mut(i) else { return Ok(()) };
            if self.start < self.end {
                let n = (self.end - self.start).min(slice.len() - at);
                slice[at..at + n].copy_from_slice(&self.buf[self.start..self.start + n]);
                self.start += n;
                at += n;
                continue;
            }
            let rest = slices[i..].iter().map(|s| s.len()).sum::<usize>() - at;
            let n = if rest >= DIRECT_READ_BYTES {
                let n = soon(|wait| recv_slices(self.fd, &mut slices[i..], at, wait))?;
                let mut left = n;
                while left > 0 {
                    let step = left.min(slices[i].len() - at);
                    at += step;
                    left -= step;
                    if at == slices[i].len() && left > 0 {
                        (i, at) = (i + 1, 0);
                    }
                }
                n
            } else {
                self.fill(true)?
            };
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
    }
}

impl Read for Inbox {
    /// Blocks until some bytes are here (a large read goes straight from the socket).
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.start == self.end {
            if out.len() >= DIRECT_READ_BYTES {
                return recv_soon(self.fd, out);
            }
            if self.fill(true)? == 0 {
                return Ok(0);
            }
        }
        let n = out.len().min(self.end - self.start);
        out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }
}

/// A payload buffer the queue has let go of, if any (an empty one if not).
fn reclaim(lent: &mut Vec<Arc<Vec<u8>>>) -> Vec<u8> {
    // Only this thread clones the buffers: one the queue let go of stays let go of.
    match lent.iter().position(|b| Arc::strong_count(b) == 1) {
        Some(i) => Arc::try_unwrap(lent.swap_remove(i)).unwrap_or_default(),
        None => Vec::new(),
    }
}

/// Payload buffers kept for the next requests once the queue lets go of them (more are freed).
const KEEP_BUFFERS: usize = 8;

/// Keeps `payload` in `lent` until the queue lets go of it, for [`reclaim`] to find; frees
/// buffers let go of beyond [`KEEP_BUFFERS`].
fn keep(lent: &mut Vec<Arc<Vec<u8>>>, payload: Arc<Vec<u8>>) {
    lent.push(payload);
    let mut free = 0;
    lent.retain(|b| {
        let keep = Arc::strong_count(b) > 1 || free < KEEP_BUFFERS;
        free += usize::from(Arc::strong_count(b) == 1);
        keep
    });
}

/// A request on the queue: what its reply needs.
struct Queued {
    handle: u64,
    budget_bytes: u64,
    length: u32,
    read: bool,
    started: Instant,
    /// The streamed write (its key in [`Book::streamed`]) this is a piece of, if any: the
    /// write is answered once all its pieces are.
    whole: Option<u64>,
}

impl Queued {
    /// A write of `length` bytes, starting now, whole.
    fn write(handle: u64, length: u32) -> Queued {
        Queued {
            handle,
            budget_bytes: length.into(),
            length,
            read: false,
            started: Instant::now(),
            whole: None,
        }
    }
}

/// A write that went to the queue in pieces.
struct Streamed {
    /// The request as its answer needs it (`whole` unset).
    request: Queued,
    /// Pieces on the queue and not yet reaped.
    left: usize,
    /// Every piece is on the queue (or was refused): once none is left, the write is answered.
    complete: bool,
    /// The first piece that failed, for the answer.
    error: Option<DeviceError>,
}

/// Where a piece of a streamed write goes: at `offset`, `len` bytes (the last piece may be
/// shorter), with `fua` as the write asked.
#[derive(Clone, Copy)]
struct Piece {
    offset: u64,
    len: usize,
    fua: bool,
}

/// A write whose payload goes straight into the device's memory (see
/// [`Conn::write_filled`]): its handle and what its header asks.
#[derive(Clone, Copy)]
struct Filled {
    handle: u64,
    offset: u64,
    length: u32,
    fua: bool,
}

/// What the connection has on the queue.
#[derive(Default)]
struct Book {
    queued: HashMap<u64, Queued>,
    streamed: HashMap<u64, Streamed>,
    next_tag: u64,
}

impl Book {
    fn tag(&mut self) -> u64 {
        self.next_tag += 1;
        self.next_tag - 1
    }
}

impl Conn<'_> {
    /// Serves the connection with `queue` until the client leaves, disconnects or breaks the
    /// protocol; every request read is answered before this returns.
    pub(super) fn pipeline(
        &self,
        mut inbox: Inbox,
        queue: &mut dyn BlockQueue,
        limits: &ExportLimits,
    ) -> Result<Ended, ConnError> {
        let mut ended: Option<Result<Ended, ConnError>> = None;
        // A request the queue had no room for yet.
        let mut waiting: Option<Job> = None;
        let mut book = Book::default();
        let mut spare = Vec::new();
        // Write payloads the queue still holds (see `BlockQueue::submit_write_shared`).
        let mut lent: Vec<Arc<Vec<u8>>> = Vec::new();
        loop {
            // Answer what finished.
            let mut progress = self.reap(queue, &mut book) > 0;
            if ended.is_some() && waiting.is_none() && queue.in_flight() == 0 {
                break;
            }
            // Take what has come in, as long as the queue has room.
            let mut looked = false;
            while ended.is_none() || waiting.is_some() {
                let mut job = match waiting.take() {
                    Some(job) => job,
                    None => {
                        match inbox.next_length() {
                            // The budget is what lets the request go on without waiting.
                            Some(len) if len <= self.budget.available() => {}
                            Some(_) if queue.in_flight() > 0 => break,
                            Some(_) => {}
                            // Nothing in flight: wait for the client (in `next_header`).
                            None if queue.in_flight() == 0 => {}
                            None if !looked => {
                                looked = true;
                                // What was submitted starts before the socket is looked at.
                                self.start(queue);
                                match inbox.fill(false) {
                                    Ok(n) if n > 0 => continue,
                                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                                    // The end of the stream or an error: `next_header` says which.
                                    _ => {}
                                }
                            }
                            None => break,
                        }
                        let (handle, action) = match self.next_header(&mut inbox, limits) {
                            Ok(Some(request)) => request,
                            Ok(None) => continue,
                            Err(end) => {
                                ended = Some(end);
                                break;
                            }
                        };
                        let piece =
                            queue.write_piece_bytes().filter(|&p| p > 0 && p <= queue.max_request_bytes());
                        let read = match (action, piece) {
                            (Action::Write { offset, length, fua }, Some(piece))
                                if length as usize > piece =>
                            {
                                let write = Queued::write(handle, length);
                                let to = Piece { offset, len: piece, fua };
                                self.stream_write(&mut inbox, queue, &mut book, &mut lent, write, to)
                                    .map(|()| None)
                            }
                            (Action::Write { offset, length, fua }, _) => {
                                let write = Filled { handle, offset, length, fua };
                                match self.write_filled(&mut inbox, queue, &mut book, write) {
                                    Ok(true) => Ok(None),
                                    Ok(false) => {
                                        self.read_payload(&mut inbox, handle, action, &mut spare).map(Some)
                                    }
                                    Err(e) => Err(e),
                                }
                            }
                            _ => self.read_payload(&mut inbox, handle, action, &mut spare).map(Some),
                        };
                        progress = true;
                        match read {
                            Ok(Some(job)) => job,
                            Ok(None) => continue,
                            Err(e) => {
                                ended = Some(Err(e));
                                break;
                            }
                        }
                    }
                };
                let tag = book.tag();
                match self.enqueue(queue, &mut job, tag, &mut lent) {
                    Enqueued::Queued(q) => {
                        book.queued.insert(tag, q);
                    }
                    Enqueued::Answered => {}
                    Enqueued::NoRoom => {
                        // Not progress: the device has to finish something first (retrying
                        // at once would only spin).
                        waiting = Some(job);
                        break;
                    }
                }
                progress = true;
                // Its payload is in the device's memory now: the buffer serves the next one (as
                // long as it is: a read into it overwrites every byte, so a buffer at least as
                // long is not zeroed again), unless it is larger than typical requests need.
                spare = std::mem::take(&mut job.payload);
                if spare.capacity() == 0 {
                    spare = reclaim(&mut lent);
                }
                if spare.capacity() > KEEP_BUFFER_BYTES {
                    spare = Vec::new();
                }
            }
            self.start(queue);
            if !progress {
                queue.wait(DEVICE_WAIT);
            }
        }
        ended.unwrap_or(Ok(Ended::Disconnected))
    }

    /// Answers every request on the queue that finished (a streamed write once all its pieces
    /// have); returns how many pieces finished.
    fn reap(&self, queue: &mut dyn BlockQueue, book: &mut Book) -> usize {
        let Book { queued, streamed, .. } = book;
        let reaped = queue.reap(&mut |tag, result| {
            let Some(q) = queued.remove(&tag) else { return };
            let Some(key) = q.whole else {
                self.answer(&q, result);
                self.budget.give(q.budget_bytes);
                return;
            };
            let Some(s) = streamed.get_mut(&key) else { return };
            s.left -= 1;
            if let Err(e) = result {
                s.error.get_or_insert(e);
            }
            if s.complete && s.left == 0 {
                if let Some(s) = streamed.remove(&key) {
                    self.answer_streamed(s);
                }
            }
        });
        reaped.unwrap_or_else(|e| {
            tracing::warn!("reaping queued requests failed: {e}");
            0
        })
    }

    fn answer_streamed(&self, s: Streamed) {
        match s.error {
            Some(e) => self.answer(&s.request, Err(e)),
            None => self.answer(&s.request, Ok(&[])),
        }
        self.budget.give(s.request.budget_bytes);
    }

    /// Reads the payload of `write` (its header read already) piece by piece (`to` says where
    /// it goes and how long a piece is) and submits each piece as soon as it is in, started at
    /// once: the device stores one while the next still comes in, where a whole payload would
    /// be read before the device saw any of it. The write is answered once every piece is
    /// reaped; a piece the queue refuses fails it (the rest of its payload is still read, and
    /// dropped). `Err` when the payload cannot be read: the connection ends (the pieces on the
    /// queue still finish).
    fn stream_write(
        &self,
        inbox: &mut Inbox,
        queue: &mut dyn BlockQueue,
        book: &mut Book,
        lent: &mut Vec<Arc<Vec<u8>>>,
        write: Queued,
        to: Piece,
    ) -> Result<(), ConnError> {
        let (length, piece) = (write.length as usize, to.len);
        self.budget.take(write.budget_bytes);
        let key = book.tag();
        book.streamed.insert(key, Streamed { request: write, left: 0, complete: false, error: None });
        let mut at = 0;
        let mut read = Ok(());
        while at < length {
            let n = piece.min(length - at);
            let mut buf = reclaim(lent);
            buf.resize(n, 0);
            let start = Instant::now();
            read = super::read_full(inbox, &mut buf, "a WRITE payload");
            bump(&self.counters.payload_ns, start.elapsed().as_nanos() as u64);
            if read.is_err() {
                break;
            }
            let Some(s) = book.streamed.get_mut(&key) else { break };
            if s.error.is_none() {
                let to = Piece { offset: to.offset + at as u64, len: n, fua: to.fua };
                self.submit_piece(queue, book, lent, key, to, buf);
            }
            at += n;
        }
        let Some(s) = book.streamed.get_mut(&key) else { return read };
        s.complete = true;
        // The device's time (`device_ns`) is what the write waits for once its payload is in.
        s.request.started = Instant::now();
        if s.left == 0 {
            if let Some(s) = book.streamed.remove(&key) {
                if read.is_ok() {
                    self.answer_streamed(s);
                } else {
                    self.budget.give(s.request.budget_bytes);
                }
            }
        }
        read
    }

    /// Offers `write` (its header read, its payload next on the wire) to a queue that reads a
    /// write's payload straight into the device's memory ([`BlockQueue::submit_write_filled`]):
    /// one copy, from the socket, where the plain way copies it into a buffer and the device
    /// copies it again. A queue without room is waited for while it has requests in flight.
    /// `Ok(true)` when it was taken (it is on the queue, or answered with the queue's error);
    /// `Ok(false)` when the queue does not take writes so, or has no room with nothing in flight
    /// (the payload is still unread); `Err` when the payload cannot be read (the connection
    /// ends).
    fn write_filled(
        &self,
        inbox: &mut Inbox,
        queue: &mut dyn BlockQueue,
        book: &mut Book,
        write: Filled,
    ) -> Result<bool, ConnError> {
        let Filled { handle, offset, length, fua } = write;
        let len = length as usize;
        if len > queue.max_request_bytes() {
            return Ok(false);
        }
        let tag = book.tag();
        let (mut read, mut failed, mut payload_ns) = (0, None, 0);
        let mut fill = |slices: &mut [&mut [u8]]| {
            let n = slices.iter().map(|s| s.len()).sum::<usize>();
            if read + n > len {
                // Bytes beyond the payload are the next request's: never read them here.
                let e = io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a queue asked for more than a WRITE payload",
                );
                failed = Some(e);
                return false;
            }
            let start = Instant::now();
            let r = inbox.read_slices(slices);
            payload_ns += start.elapsed().as_nanos() as u64;
            match r {
                Ok(()) => read += n,
                Err(e) => failed = Some(e),
            }
            failed.is_none()
        };
        let submitted = loop {
            match queue.submit_write_filled(tag, offset, len, fua, &mut fill) {
                // No room until requests in flight finish: wait for them here, the payload
                // left on the wire (reading it into a buffer of the connection's would only
                // copy it once more, and nothing behind it can be read before it anyway).
                Some(Ok(false)) if queue.in_flight() > 0 => {
                    self.start(queue);
                    if self.reap(queue, book) == 0 {
                        queue.wait(DEVICE_WAIT);
                    }
                }
                submitted => break submitted,
            }
        };
        bump(&self.counters.payload_ns, payload_ns);
        match (submitted, failed) {
            (None, _) | (Some(Ok(false)), None) if read == 0 => return Ok(false),
            (_, Some(e)) => {
                // What the queue took of it still finishes, unanswered: the connection ends.
                return Err(super::read_error(e, "a WRITE payload"));
            }
            (Some(Ok(true)), None) => {
                self.budget.take(length.into());
                book.queued.insert(tag, Queued::write(handle, length));
            }
            (Some(Err(e)), None) => {
                bump(&self.counters.device_errors, 1);
                let _ = self.send(&reply_header(handle, Errno::of(&e).as_u32()));
            }
            (None | Some(Ok(false)), None) => {
                // Part of the payload taken without the write: a queue that broke its word.
                bump(&self.counters.device_errors, 1);
                let _ = self.send(&reply_header(handle, Errno::Io.as_u32()));
            }
        }
        // A write the queue stopped partway leaves the rest of its payload on the wire.
        let mut rest = vec![0u8; len - read];
        super::read_full(inbox, &mut rest, "a WRITE payload")?;
        Ok(true)
    }

    /// Submits `buf`, piece `to` of streamed write `key`, and starts it, waiting for room on
    /// the queue if it has none; a piece it refuses for want of room when nothing is in flight
    /// is written the plain way.
    fn submit_piece(
        &self,
        queue: &mut dyn BlockQueue,
        book: &mut Book,
        lent: &mut Vec<Arc<Vec<u8>>>,
        key: u64,
        to: Piece,
        buf: Vec<u8>,
    ) {
        let Piece { offset, fua, .. } = to;
        let tag = book.tag();
        let payload = Arc::new(buf);
        loop {
            let submitted = queue.submit_write_shared(tag, offset, &payload, fua);
            let error = match submitted {
                Ok(true) => {
                    let Some(s) = book.streamed.get_mut(&key) else { break };
                    s.left += 1;
                    let piece = Queued { whole: Some(key), ..s.request };
                    book.queued.insert(tag, piece);
                    self.start(queue);
                    break;
                }
                Ok(false) if queue.in_flight() > 0 => {
                    if self.reap(queue, book) == 0 {
                        queue.wait(DEVICE_WAIT);
                    }
                    continue;
                }
                Ok(false) => self.device.write_at(offset, &payload, fua).err(),
                Err(e) => Some(e),
            };
            if let Some(e) = error {
                bump(&self.counters.device_errors, 1);
                if let Some(s) = book.streamed.get_mut(&key) {
                    s.error.get_or_insert(e);
                }
            }
            break;
        }
        keep(lent, payload);
    }

    fn start(&self, queue: &mut dyn BlockQueue) {
        if let Err(e) = queue.start() {
            tracing::warn!("starting queued requests failed: {e}");
        }
    }

    /// Submits a read or write to `queue` under `tag`, or runs any other request here and
    /// answers it.
    fn enqueue(
        &self,
        queue: &mut dyn BlockQueue,
        job: &mut Job,
        tag: u64,
        lent: &mut Vec<Arc<Vec<u8>>>,
    ) -> Enqueued {
        let fits = |len: u32| len as usize <= queue.max_request_bytes();
        let (submitted, length, read) = match job.action {
            Action::Read { offset, length } if fits(length) => {
                (queue.submit_read(tag, offset, length as usize), length, true)
            }
            Action::Write { offset, length, fua } if fits(length) => {
                let payload = Arc::new(std::mem::take(&mut job.payload));
                let submitted = queue.submit_write_shared(tag, offset, &payload, fua);
                // A queue that kept no hold (it copied, had no room, or failed) hands the
                // payload back to the job; one that holds it gives it back later (`reclaim`).
                match Arc::try_unwrap(payload) {
                    Ok(payload) => job.payload = payload,
                    Err(held) => keep(lent, held),
                }
                (submitted, length, false)
            }
            _ => {
                // In order: what was submitted before this starts first.
                self.start(queue);
                self.run_here(job);
                return Enqueued::Answered;
            }
        };
        match submitted {
            Ok(true) => Enqueued::Queued(Queued {
                handle: job.handle,
                budget_bytes: job.budget_bytes,
                length,
                read,
                started: Instant::now(),
                whole: None,
            }),
            // No room, and nothing in flight to make any: the plain way.
            Ok(false) if queue.in_flight() == 0 => {
                self.run_here(job);
                Enqueued::Answered
            }
            Ok(false) => Enqueued::NoRoom,
            Err(e) => {
                bump(&self.counters.device_errors, 1);
                let _ = self.send(&reply_header(job.handle, Errno::of(&e).as_u32()));
                self.budget.give(job.budget_bytes);
                Enqueued::Answered
            }
        }
    }

    /// Runs a request through the device's plain calls and answers it.
    fn run_here(&self, job: &Job) {
        if !self.read_lent(job) {
            let mut reply = Vec::new();
            self.execute(job, &mut reply);
            let start = Instant::now();
            let _ = self.send(&reply);
            bump(&self.counters.reply_ns, start.elapsed().as_nanos() as u64);
        }
        self.budget.give(job.budget_bytes);
    }

    /// Answers a request the queue finished.
    fn answer(&self, q: &Queued, result: Reaped<'_>) {
        let c = self.counters;
        bump(&c.device_ns, q.started.elapsed().as_nanos() as u64);
        let start = Instant::now();
        let header = reply_header(q.handle, 0);
        match result {
            Ok(_) if !q.read => {
                bump(&c.bytes_written, q.length.into());
                let _ = self.send(&header);
            }
            Ok(data) => {
                bump(&c.bytes_read, q.length.into());
                let mut parts = Vec::with_capacity(data.len() + 1);
                parts.push(&header[..]);
                parts.extend_from_slice(data);
                let _ = self.send_parts(&parts);
            }
            Err(e) => {
                bump(&c.device_errors, 1);
                let _ = self.send(&reply_header(q.handle, Errno::of(&e).as_u32()));
            }
        }
        bump(&c.reply_ns, start.elapsed().as_nanos() as u64);
    }
}

/// What became of a request handed to [`Conn::enqueue`].
enum Enqueued {
    /// On the queue.
    Queued(Queued),
    /// Run and answered (or refused) already.
    Answered,
    /// The queue has no room for it until requests in flight finish.
    NoRoom,
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    /// Slices of odd sizes over `buf`, as pages of a device's memory might be.
    fn slices(buf: &mut [u8]) -> Vec<&mut [u8]> {
        let mut out = Vec::new();
        let mut rest = buf;
        for size in [1, 4095, 3000, 70_000].into_iter().cycle() {
            if rest.is_empty() {
                break;
            }
            let (head, tail) = rest.split_at_mut(size.min(rest.len()));
            out.push(head);
            rest = tail;
        }
        out
    }

    #[test]
    fn slices_fill_from_the_buffer_then_the_socket() {
        let data: Vec<u8> = (0..700_000u32).map(|i| (i % 251) as u8).collect();
        for (buffered, size) in [(0, 700_000), (1000, 700_000), (0, 5000), (3000, 4000), (50_000, 300_000)] {
            let (mut tx, rx) = UnixStream::pair().unwrap();
            let mut inbox = Inbox::new(rx.as_raw_fd(), &data[..buffered]);
            let sent = data[buffered..size].to_vec();
            // More than the socket holds: the writer blocks until the reader takes it.
            let writer = std::thread::spawn(move || tx.write_all(&sent).map(|()| tx));
            let mut got = vec![0u8; size];
            inbox.read_slices(&mut slices(&mut got)).unwrap();
            assert!(got == data[..size], "{buffered} buffered, {size} in all");
            let tx = writer.join().unwrap().unwrap();
            // The client closes before the next payload is whole.
            drop(tx);
            let err = inbox.read_slices(&mut slices(&mut vec![0u8; 200_000])).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        }
    }
}
