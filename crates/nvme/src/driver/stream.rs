//! A queue pair held by one client that keeps many requests in flight ([`IoStream`]).
//!
//! The driver's plain calls ([`NvmeDriver::read_lent`], [`NvmeDriver::write`], ...) take a free
//! queue pair, run one request on it and wait for it: a thread per request in flight, each
//! polling for its own completion. A client with many requests at once (an NBD connection at
//! depth 32) would need as many threads, which on a small machine spend their time handing the
//! cores to each other. A stream instead belongs to one thread: it submits requests as they come
//! (their entries go out with one doorbell for all that were submitted together), reaps every
//! completion that arrived in one pass, and waits on the queue's own interrupt only when none
//! has.
//!
//! A stream reserves one I/O queue pair for as long as it lives; the plain calls then use the
//! others (the first pair is never reserved, so they always have one). [`NvmeDriver::stream`]
//! returns `None` when no pair is left to reserve.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::memory::DmaBuf;
use super::{lock, DriverError, NvmeDriver, Pending, QueuePair, Result};
use crate::command::{Completion, SQE_LEN};
use crate::controller::reg;

/// A write piece of at least this many bytes is started as soon as its data is copied.
const START_AT_ONCE_BYTES: usize = 64 << 10;

/// One request of a stream, finished: its tag, its outcome and, for a read, its data where it
/// lies in DMA memory until this is dropped.
pub struct Finished<'d> {
    /// The tag the request was submitted with.
    pub tag: u64,
    /// Success, or the first error of its commands.
    pub result: Result<()>,
    /// For a read: its buffers and how many bytes of each are the request's, in order.
    data: Vec<(DmaBuf<'d>, usize)>,
    drv: &'d NvmeDriver,
}

impl Finished<'_> {
    /// Lends a successful read's data to `f`, as slices of the DMA memory itself (no copy);
    /// a write lends nothing (`f` gets no slices).
    pub fn lend(&self, f: &mut dyn FnMut(&[&[u8]])) -> Result<()> {
        let runs: Vec<(u64, usize)> = self.data.iter().map(|(b, n)| (b.addr, *n)).collect();
        if runs.is_empty() {
            f(&[]);
            return Ok(());
        }
        self.drv.mem.lend(&runs, f)?;
        Ok(())
    }
}

/// A command in flight: its request and the memory it owns until it completes.
struct InFlight<'d> {
    tag: u64,
    piece: usize,
    opcode: u8,
    data: Option<DmaBuf<'d>>,
    lists: Vec<DmaBuf<'d>>,
    deadline: Instant,
}

/// A request in flight: its commands' outcomes.
struct Request<'d> {
    left: usize,
    /// Bytes of the request.
    len: usize,
    read: bool,
    pieces: Vec<Option<(DmaBuf<'d>, usize)>>,
    error: Option<DriverError>,
    /// When it was submitted.
    started: Instant,
}

/// A queue pair reserved for one client, with any number of requests in flight. Not shared
/// between threads: one thread submits, rings, reaps and waits.
pub struct IoStream<'d> {
    drv: &'d NvmeDriver,
    /// Index of the reserved pair in the driver's I/O queues.
    index: usize,
    qid: u16,
    vector: u16,
    /// Entries written to the queue but not yet announced by the doorbell.
    staged: usize,
    commands: HashMap<u16, InFlight<'d>>,
    requests: HashMap<u64, Request<'d>>,
    /// Since when a request has been in flight: the stream's time counts as the driver's
    /// (`io_ns`) while one is, once however many overlap.
    busy_since: Option<Instant>,
}

impl NvmeDriver {
    /// Reserves an I/O queue pair for a client that keeps many requests in flight; `None` when
    /// every pair but the first is reserved already (the plain calls keep that one).
    pub fn stream(&self) -> Option<IoStream<'_>> {
        if self.shut_down.load(Ordering::Acquire) {
            return None;
        }
        for index in 1..self.io.len() {
            // AcqRel: the flag hands the pair over; the queue's lock orders its contents.
            if !self.reserved[index].swap(true, Ordering::AcqRel) {
                let q = lock(&self.io[index]);
                let (qid, vector) = (q.qid, q.vector);
                drop(q);
                return Some(IoStream {
                    drv: self,
                    index,
                    qid,
                    vector,
                    staged: 0,
                    commands: HashMap::new(),
                    requests: HashMap::new(),
                    busy_since: None,
                });
            }
        }
        None
    }
}

impl<'d> IoStream<'d> {
    /// The largest request a stream takes: as much as one plain request has in flight
    /// ([`DriverConfig::max_inflight_bytes`](super::DriverConfig::max_inflight_bytes)).
    pub fn max_request_bytes(&self) -> usize {
        self.drv.window_bytes()
    }

    /// Commands a request of `len` bytes takes at most (a transfer is split at MDTS, a write
    /// sent as its data arrives finer: see [`DriverConfig::pipelined_write_bytes`]).
    ///
    /// [`DriverConfig::pipelined_write_bytes`]: super::DriverConfig::pipelined_write_bytes
    pub fn commands_for(&self, len: usize) -> usize {
        // The smallest command of any request (`pipelined_chunk_bytes` never exceeds MDTS).
        len.div_ceil(self.drv.pipelined_chunk_bytes()).max(1)
    }

    /// The command size of a write split finer than MDTS (its data goes into the memory
    /// buffer: see [`DriverConfig::pipelined_write_bytes`]), if writes are: a caller that has a
    /// larger write's data as it arrives can submit it in pieces of this size, each started at
    /// once, and the controller stores one while the next is still on its way. `None` when a
    /// write's commands are as large as MDTS allows.
    ///
    /// [`DriverConfig::pipelined_write_bytes`]: super::DriverConfig::pipelined_write_bytes
    pub fn write_piece_bytes(&self) -> Option<usize> {
        let piece = self.drv.write_chunk_bytes();
        (piece < self.drv.chunk_bytes()).then_some(piece)
    }

    /// Whether a request of `len` bytes fits in the queue now, besides what is in flight.
    pub fn room_for(&self, len: usize) -> bool {
        let q = lock(&self.drv.io[self.index]);
        q.free_slots() as usize >= self.commands_for(len)
    }

    /// Requests in flight (submitted and not yet reaped).
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }

    /// Bytes of the requests in flight.
    pub fn in_flight_bytes(&self) -> usize {
        self.requests.values().map(|r| r.len).sum()
    }

    /// Submits a read of `len` bytes at byte `offset` (both multiples of the block size) under
    /// `tag`, which must not be in flight already. Its entries go out at the next
    /// [`IoStream::ring`].
    pub fn submit_read(&mut self, tag: u64, offset: u64, len: usize) -> Result<()> {
        self.submit(tag, offset, len, None, false)
    }

    /// Submits a write of `data` at byte `offset` (both multiples of the block size) under
    /// `tag`. The data is copied into DMA memory (or the controller's memory buffer) now; the
    /// pieces of a write of 64 KiB or more start as their data is in (the rest at the next
    /// [`IoStream::ring`]).
    pub fn submit_write(&mut self, tag: u64, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.submit(tag, offset, data.len(), Some(WriteData::Borrowed(data)), fua)
    }

    /// [`IoStream::submit_write`] of bytes the caller shares: where they go into the
    /// controller's memory buffer, the bridge's thread copies them into the fabric's frames
    /// (holding `data` until then) instead of this one. The caller may take `data` back once
    /// it is the only holder again.
    pub fn submit_write_shared(
        &mut self,
        tag: u64,
        offset: u64,
        data: &Arc<Vec<u8>>,
        fua: bool,
    ) -> Result<()> {
        self.submit(tag, offset, data.len(), Some(WriteData::Shared(data)), fua)
    }

    /// Whether [`IoStream::submit_write_filled`] takes writes: their data goes into host
    /// memory (not the controller's memory buffer) that the driver can lend in place.
    pub fn writes_in_place(&self) -> bool {
        self.drv.mem.lends_in_place() && !self.drv.cmb.as_ref().is_some_and(|c| c.write_data)
    }

    /// Submits a write of `len` bytes at byte `offset` (both multiples of the block size)
    /// under `tag` whose data `fill` puts straight into the DMA buffers: it is called once per
    /// command, in order, with that command's buffer as slices of the memory itself, and
    /// returns `false` when it could not fill them (the write stops there: its commands so far
    /// finish it, with an error; before the first, nothing is submitted). The caller's data is
    /// not copied again: the controller reads it where `fill` put it. The commands are of
    /// [`DriverConfig::pipelined_write_bytes`](super::DriverConfig::pipelined_write_bytes) at
    /// most, and one of 64 KiB or more starts as soon as it is filled: the controller fetches
    /// it while the caller still receives the next. `None` when the stream does not take
    /// writes this way ([`IoStream::writes_in_place`]); `fill` is not called when this returns
    /// an error before the first command (a bad range, no room).
    pub fn submit_write_filled(
        &mut self,
        tag: u64,
        offset: u64,
        len: usize,
        fua: bool,
        fill: &mut dyn FnMut(&mut [&mut [u8]]) -> bool,
    ) -> Option<Result<()>> {
        if !self.writes_in_place() {
            return None;
        }
        Some(self.submit(tag, offset, len, Some(WriteData::Filled(fill)), fua))
    }

    fn submit(
        &mut self,
        tag: u64,
        offset: u64,
        len: usize,
        mut data: Option<WriteData<'_>>,
        fua: bool,
    ) -> Result<()> {
        let drv = self.drv;
        let bs = drv.identity.lba_size as usize;
        if len == 0 || !offset.is_multiple_of(bs as u64) || !len.is_multiple_of(bs) {
            return Err(DriverError::InvalidArgument(format!(
                "{offset}+{len} is empty or not in whole {bs}-byte blocks"
            )));
        }
        if self.requests.contains_key(&tag) {
            return Err(DriverError::InvalidArgument(format!("tag {tag} is in flight already")));
        }
        drv.byte_range(offset, len)?;
        if len > self.max_request_bytes() || !self.room_for(len) {
            return Err(DriverError::InvalidArgument(format!(
                "no room in queue {} for {len} bytes",
                self.qid
            )));
        }
        let started = Instant::now();
        let lba = offset / bs as u64;
        let chunk = match &data {
            Some(WriteData::Filled(_)) => drv.pipelined_chunk_bytes(),
            Some(_) => drv.write_chunk_bytes(),
            None => drv.chunk_bytes(),
        };
        // Build every command first: a request goes in whole or not at all.
        let mut cmds = Vec::with_capacity(len.div_ceil(chunk));
        for at in (0..len).step_by(chunk) {
            let n = chunk.min(len - at);
            cmds.push((at, drv.rw_command_unfilled(data.is_some(), lba + (at / bs) as u64, n, fua)?));
        }
        let pieces = cmds.len();
        let mut request =
            Request { left: pieces, len, read: data.is_none(), pieces: Vec::new(), error: None, started };
        request.pieces.resize_with(pieces, || None);
        for (piece, (at, mut cmd)) in cmds.into_iter().enumerate() {
            let staged = match (&mut data, &cmd.data) {
                (Some(d), Some(buf)) => {
                    let copy = Instant::now();
                    let range = at..(at + chunk).min(len);
                    let r = match d {
                        WriteData::Borrowed(d) => drv.put(buf.addr, &d[range]),
                        WriteData::Shared(d) => drv.put_shared(buf.addr, d, range),
                        WriteData::Filled(fill) => fill_in_place(drv, buf.addr, range.len(), fill),
                    };
                    if !matches!(d, WriteData::Filled(_)) {
                        // Statistics counter: Relaxed, nothing is ordered by it.
                        drv.stats.copy_ns.fetch_add(copy.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    }
                    r
                }
                _ => Ok(()),
            };
            // The queue's lock only once the data is in: a caller's `fill` may wait for it.
            let mut q = lock(&drv.io[self.index]);
            let staged = staged.and_then(|()| self.stage(&mut q, &mut cmd));
            if let Err(e) = staged {
                if piece == 0 {
                    return Err(e);
                }
                // The pieces already in the queue finish the request, with this error.
                request.left = piece;
                request.error = Some(e);
                break;
            }
            // In the queue now: the command and its buffers are kept until it completes or
            // times out, whatever happens next.
            let Pending { sqe, data: buf, lists, .. } = cmd;
            let deadline = Instant::now() + drv.cfg.io_timeout;
            self.commands
                .insert(sqe.cid, InFlight { tag, piece, opcode: sqe.opcode, data: buf, lists, deadline });
            // A large write's piece starts at once: the controller writes it to its store while
            // the next piece's data is copied, rather than waiting for all of them.
            if data.is_some() && chunk.min(len) >= START_AT_ONCE_BYTES {
                if let Err(e) = drv.bar.write32(reg::sq_tail(q.qid), q.sq_tail) {
                    request.left = piece + 1;
                    request.error = Some(e.into());
                    break;
                }
                self.staged = 0;
            }
        }
        self.busy_since.get_or_insert(request.started);
        self.requests.insert(tag, request);
        Ok(())
    }

    /// Writes one entry at the queue's tail (the doorbell waits for [`IoStream::ring`]).
    fn stage(&mut self, q: &mut QueuePair, cmd: &mut Pending<'d>) -> Result<()> {
        cmd.sqe.cid = q.next_cid;
        q.next_cid = q.next_cid.wrapping_add(1);
        self.drv.put(q.sq_base + u64::from(q.sq_tail) * SQE_LEN as u64, &cmd.sqe.to_bytes())?;
        q.sq_tail = (q.sq_tail + 1) % q.entries;
        self.staged += 1;
        Ok(())
    }

    /// Rings the submission doorbell once for every entry submitted since the last ring.
    pub fn ring(&mut self) -> Result<()> {
        if self.staged == 0 {
            return Ok(());
        }
        let q = lock(&self.drv.io[self.index]);
        self.drv.bar.write32(reg::sq_tail(q.qid), q.sq_tail)?;
        self.staged = 0;
        Ok(())
    }

    /// Takes every completion that has arrived and appends the requests they finished to `out`
    /// (without waiting). Requests whose time ran out finish with [`DriverError::Timeout`];
    /// their buffers are never reused (the controller might still write them). Returns how
    /// many requests finished.
    pub fn reap(&mut self, out: &mut Vec<Finished<'d>>) -> Result<usize> {
        let drv = self.drv;
        let before = out.len();
        let mut q = lock(&drv.io[self.index]);
        let mut reaped = 0;
        while let Some(c) = q.next_completion(&*drv.mem)? {
            reaped += 1;
            match self.commands.remove(&c.cid).filter(|_| c.sq_id == q.qid) {
                Some(cmd) => self.complete(cmd, Some(c), out),
                // Statistics counter: Relaxed, nothing is ordered by it.
                None => _ = drv.stats.stray_completions.fetch_add(1, Ordering::Relaxed),
            }
        }
        if reaped > 0 {
            drv.bar.write32(reg::cq_head(q.qid), q.cq_head)?;
            // Statistics counter: Relaxed, nothing is ordered by it.
            drv.stats.commands.fetch_add(reaped as u64, Ordering::Relaxed);
        } else if !self.commands.is_empty() {
            let now = Instant::now();
            let late: Vec<u16> =
                self.commands.iter().filter(|(_, c)| c.deadline <= now).map(|(cid, _)| *cid).collect();
            for cid in late {
                if let Some(cmd) = self.commands.remove(&cid) {
                    self.complete(cmd, None, out);
                }
            }
        }
        Ok(out.len() - before)
    }

    /// Records one command's end (`None`: its time ran out) and finishes its request when it
    /// was the last.
    fn complete(&mut self, cmd: InFlight<'d>, c: Option<Completion>, out: &mut Vec<Finished<'d>>) {
        let InFlight { tag, piece, opcode, data, lists, .. } = cmd;
        let Some(req) = self.requests.get_mut(&tag) else { return };
        req.left -= 1;
        match c {
            Some(c) if c.status.is_success() => {
                if req.read {
                    // Every piece is a whole chunk but the last.
                    let chunk = self.drv.chunk_bytes();
                    let len = chunk.min(req.len - piece * chunk);
                    req.pieces[piece] = data.map(|d| (d, len));
                }
            }
            Some(c) => {
                req.error.get_or_insert(DriverError::Status { status: c.status, opcode, qid: self.qid });
            }
            None => {
                for b in data.into_iter().chain(lists) {
                    // Statistics counter: Relaxed, nothing is ordered by it.
                    self.drv.stats.quarantined_pages.fetch_add(b.pages as u64, Ordering::Relaxed);
                    std::mem::forget(b);
                }
                req.error.get_or_insert(DriverError::Timeout(format!(
                    "command {opcode:#04x} on queue {} (a streamed request)",
                    self.qid
                )));
            }
        }
        if req.left > 0 {
            return;
        }
        let Some(req) = self.requests.remove(&tag) else { return };
        if let Some(since) = self.busy_since.take_if(|_| self.requests.is_empty()) {
            // Statistics counter: Relaxed, nothing is ordered by it.
            self.drv.stats.io_ns.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        let (result, data) = match req.error {
            Some(e) => (Err(e), Vec::new()),
            None => (Ok(()), req.pieces.into_iter().flatten().collect()),
        };
        out.push(Finished { tag, result, data, drv: self.drv });
    }

    /// Waits until a completion may have arrived: polls the completion queue for the
    /// driver's [`poll_spin`](super::DriverConfig::poll_spin) in
    /// [`CompletionMode::Poll`](super::CompletionMode::Poll), then sleeps on the queue's
    /// interrupt for at most `timeout`. Returns at once when nothing is in flight.
    pub fn wait(&mut self, timeout: Duration) {
        if self.commands.is_empty() {
            return;
        }
        let drv = self.drv;
        if drv.cfg.completion == super::CompletionMode::Poll {
            let start = Instant::now();
            let mut spins = 0u32;
            while start.elapsed() < drv.cfg.poll_spin {
                if self.arrived() {
                    return;
                }
                spins += 1;
                if spins < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
        if !self.arrived() && drv.irq.wait_vector(self.vector, timeout) {
            // Statistics counter: Relaxed, nothing is ordered by it.
            drv.stats.interrupts.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether the entry at the completion queue's head has been written.
    fn arrived(&self) -> bool {
        // A failed read ends the wait too: the next reap reports the error.
        lock(&self.drv.io[self.index]).peek_completion(&*self.drv.mem).map_or(true, |c| c.is_some())
    }
}

impl Drop for IoStream<'_> {
    /// Waits for what is still in flight (at most the driver's I/O timeout), then gives the
    /// queue pair back.
    fn drop(&mut self) {
        let _ = self.ring();
        let mut out = Vec::new();
        while !self.commands.is_empty() {
            if self.reap(&mut out).is_err() {
                break;
            }
            out.clear();
            self.wait(Duration::from_millis(5));
        }
        // Commands that never completed keep their buffers out of use for good.
        for (_, cmd) in self.commands.drain() {
            for b in cmd.data.into_iter().chain(cmd.lists) {
                // Statistics counter: Relaxed, nothing is ordered by it.
                self.drv.stats.quarantined_pages.fetch_add(b.pages as u64, Ordering::Relaxed);
                std::mem::forget(b);
            }
        }
        // Release: the pair's state is published by its lock, the flag hands it back.
        self.drv.reserved[self.index].store(false, Ordering::Release);
    }
}

/// A write's data as its caller hands it over.
enum WriteData<'a> {
    Borrowed(&'a [u8]),
    Shared(&'a Arc<Vec<u8>>),
    /// Put into the DMA buffers by the caller (see [`IoStream::submit_write_filled`]).
    Filled(&'a mut dyn FnMut(&mut [&mut [u8]]) -> bool),
}

/// Lends the `len` bytes of DMA memory at `addr` to `fill` to write in place.
fn fill_in_place(
    drv: &NvmeDriver,
    addr: u64,
    len: usize,
    fill: &mut dyn FnMut(&mut [&mut [u8]]) -> bool,
) -> Result<()> {
    let mut filled = false;
    drv.mem.lend_mut(addr, len, &mut |slices| filled = fill(slices))?;
    match filled {
        true => Ok(()),
        false => Err(DriverError::InvalidArgument("a write's data did not come".into())),
    }
}
