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
//! costs more than the look on these shared cores). Requests the queue does not take (flush,
//! trim, write zeroes, larger than the queue's limit) run the plain way, on this thread, in the
//! order they came.

use std::collections::HashMap;
use std::io::{self, Read};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{bump, reply_header, Conn, ConnError, Ended, ExportLimits, Job, KEEP_BUFFER_BYTES};
use crate::device::{BlockQueue, Reaped};
use crate::proto::{Action, Command, RequestHeader};

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
        if wait {
            // A client at depth one sends its next request soon after its reply: look for it
            // without sleeping for a little while, which saves the wake-up.
            let until = Instant::now() + SOCKET_SPIN;
            while Instant::now() < until {
                match recv(self.fd, &mut self.buf[self.end..], false) {
                    Ok(n) => {
                        self.end += n;
                        return Ok(n);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                    Err(e) => return Err(e),
                }
            }
        }
        let n = recv(self.fd, &mut self.buf[self.end..], wait)?;
        self.end += n;
        Ok(n)
    }

    /// Whether a whole request (header and, for a write, its payload) is buffered, and the
    /// bytes of its payload: `None` when not, or when the header is not one (the reader then
    /// finds out).
    fn whole_request(&self) -> Option<u64> {
        let b = self.buffered();
        let h = RequestHeader::parse(b.get(..RequestHeader::LEN)?).ok()?;
        let payload = if h.command == Command::Write { u64::from(h.length) } else { 0 };
        ((b.len() - RequestHeader::LEN) as u64 >= payload).then_some(u64::from(h.length))
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

impl Read for Inbox {
    /// Blocks until some bytes are here (a large read goes straight from the socket).
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.start == self.end {
            if out.len() >= self.buf.len() {
                return recv(self.fd, out, true);
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

/// A payload buffer the queue has let go of, if any (an empty one if not); the others it has
/// let go of are freed, the ones it still holds stay.
fn reclaim(lent: &mut Vec<Arc<Vec<u8>>>) -> Vec<u8> {
    let mut found = Vec::new();
    let mut i = 0;
    while i < lent.len() {
        if Arc::strong_count(&lent[i]) > 1 {
            i += 1;
            continue;
        }
        if let Ok(buffer) = Arc::try_unwrap(lent.swap_remove(i)) {
            if found.capacity() == 0 {
                found = buffer;
            }
        }
    }
    found
}

/// A request on the queue: what its reply needs.
struct Queued {
    handle: u64,
    budget_bytes: u64,
    length: u32,
    read: bool,
    started: Instant,
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
        let mut queued: HashMap<u64, Queued> = HashMap::new();
        let mut next_tag = 0u64;
        let mut spare = Vec::new();
        // Write payloads the queue still holds (see `BlockQueue::submit_write_shared`).
        let mut lent: Vec<Arc<Vec<u8>>> = Vec::new();
        loop {
            // Answer what finished.
            let reaped = queue.reap(&mut |tag, result| {
                let Some(q) = queued.remove(&tag) else { return };
                self.answer(&q, result);
                self.budget.give(q.budget_bytes);
            });
            let mut progress = match reaped {
                Ok(n) => n > 0,
                Err(e) => {
                    tracing::warn!("reaping queued requests failed: {e}");
                    false
                }
            };
            if ended.is_some() && waiting.is_none() && queue.in_flight() == 0 {
                break;
            }
            // Take what has come in, as long as the queue has room.
            let mut looked = false;
            while ended.is_none() || waiting.is_some() {
                let mut job = match waiting.take() {
                    Some(job) => job,
                    None => {
                        match inbox.whole_request() {
                            // The budget is what lets `next_request` go on without waiting.
                            Some(len) if len <= self.budget.available() => {}
                            Some(_) if queue.in_flight() > 0 => break,
                            Some(_) => {}
                            // Nothing in flight: wait for the client (in `next_request`).
                            None if queue.in_flight() == 0 => {}
                            None if !looked => {
                                looked = true;
                                // What was submitted starts before the socket is looked at.
                                self.start(queue);
                                match inbox.fill(false) {
                                    Ok(n) if n > 0 => continue,
                                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                                    // The end of the stream or an error: `next_request` says which.
                                    _ => {}
                                }
                            }
                            None => break,
                        }
                        match self.next_request(&mut inbox, limits, &mut spare) {
                            Ok(Some(job)) => job,
                            Ok(None) => continue,
                            Err(end) => {
                                ended = Some(end);
                                break;
                            }
                        }
                    }
                };
                match self.enqueue(queue, &mut job, next_tag, &mut lent) {
                    Enqueued::Queued(q) => {
                        queued.insert(next_tag, q);
                        next_tag += 1;
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
                    Err(held) => lent.push(held),
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
            }),
            // No room, and nothing in flight to make any: the plain way.
            Ok(false) if queue.in_flight() == 0 => {
                self.run_here(job);
                Enqueued::Answered
            }
            Ok(false) => Enqueued::NoRoom,
            Err(e) => {
                bump(&self.counters.device_errors, 1);
                let _ = self.send(&reply_header(job.handle, e.errno().as_u32()));
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
                let _ = self.send(&reply_header(q.handle, e.errno().as_u32()));
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
