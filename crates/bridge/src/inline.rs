//! Sans-IO device models run inline, on the device runtime's receive thread.
//!
//! Layer: pcie engine, device side. A [`HostedFunction::model`](super::HostedFunction::model)
//! never blocks, so the device bridge serves its configuration and memory requests, feeds its DMA
//! read completions and runs it right where the TLPs arrive; the TLPs it sends (completions, DMA
//! reads and writes, MSI-X) collect in a [`TlpOut`] that the caller flushes into the runtime's
//! outbox (no worker thread, no queue, no wake-up per TLP). [`InlinePath`] is the fabric [`Path`]
//! of such a function: tagged reads split by max read request size, reassembled from their
//! completions ([`Reads`], which a blocking function's worker path uses too); posted writes
//! split by max payload size.
//!
//! Invariant: everything here runs under the function's mutex; the caller takes the session
//! snapshot (host, channel) under the session lock and holds that lock while the function uses
//! it (lock order: session, then function), so the session lock is never taken inside and a
//! host lost meanwhile is never put back. Only the receive thread sends the function's output.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanbus_runtime::Sender;
use lanbus_wire::MacAddr;

use super::device::{bump, Counters};
use super::hosted::{OpId, Path};
use lanbus_pcie::device::DmaError;
use lanbus_pcie::request::{split, Chunk, RequestShape};
use lanbus_pcie::{Bdf, CplStatus, Error, Header, Progress, ReadReassembly, Tag, Tlp};

/// Encoded TLPs waiting to be handed to the runtime, in one byte arena reused from call to call.
#[derive(Default)]
pub(crate) struct TlpOut {
    bytes: Vec<u8>,
    /// (peer, channel, length) of each TLP, in order.
    items: Vec<(MacAddr, u16, usize)>,
}

impl TlpOut {
    /// Encodes `tlp` for `peer` on `channel` (a TLP that does not encode is dropped: the bridge
    /// only builds valid ones).
    pub(crate) fn push(&mut self, peer: MacAddr, channel: u16, tlp: &Tlp) {
        let start = self.bytes.len();
        self.bytes.resize(start + tlp.buffer_len(), 0);
        match tlp.emit(&mut self.bytes[start..]) {
            Ok(n) => {
                self.bytes.truncate(start + n);
                self.items.push((peer, channel, n));
            }
            Err(_) => self.bytes.truncate(start),
        }
    }

    /// Encodes a memory write of `data` by `me` with `shape` for `peer` on `channel`: the
    /// header, then the payload straight from `data` (`at` zero bytes before it up to the first
    /// byte enabled, zeros after it to the last DW), without building a [`Tlp`] around a copy.
    pub(crate) fn push_mem_write(
        &mut self,
        peer: MacAddr,
        channel: u16,
        me: Bdf,
        shape: &RequestShape,
        at: usize,
        data: &[u8],
    ) {
        let n = append_mem_write(&mut self.bytes, me, shape, at, data);
        self.items.push((peer, channel, n));
    }

    /// Whether no TLP waits.
    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Queues every TLP on `sender` in order (one lock and wake-up per run of TLPs for the same
    /// peer and channel) and empties the arena.
    pub(crate) fn send_via(&mut self, sender: &Sender) {
        let mut at = 0;
        let mut i = 0;
        while i < self.items.len() {
            let (peer, channel, _) = self.items[i];
            let run = self.items[i..].iter().take_while(|(p, c, _)| (*p, *c) == (peer, channel)).count();
            let bytes = &self.bytes;
            let mut pos = at;
            sender.send_all(
                peer,
                channel,
                self.items[i..i + run].iter().map(|(_, _, n)| {
                    let b = &bytes[pos..pos + n];
                    pos += n;
                    b
                }),
            );
            at += self.items[i..i + run].iter().map(|(_, _, n)| n).sum::<usize>();
            i += run;
        }
        self.items.clear();
        self.bytes.clear();
    }

    /// Hands every TLP to `send` in order and empties the arena.
    pub(crate) fn drain(&mut self, mut send: impl FnMut(MacAddr, u16, &[u8])) {
        let mut at = 0;
        for (peer, channel, n) in self.items.drain(..) {
            send(peer, channel, &self.bytes[at..at + n]);
            at += n;
        }
        self.bytes.clear();
    }
}

/// Appends to `bytes` a memory write of `data` by `me` with `shape`: the header, then the payload
/// straight from `data` (`at` zero bytes before it up to the first byte enabled, zeros after it to
/// the last DW), without building a [`Tlp`] around a copy. Returns the TLP's length.
pub(crate) fn append_mem_write(
    bytes: &mut Vec<u8>,
    me: Bdf,
    shape: &RequestShape,
    at: usize,
    data: &[u8],
) -> usize {
    let mut tlp = Tlp::mem_write(me, shape.address, shape.first_be, shape.last_be, Vec::new());
    tlp.length_dw = shape.length_dw;
    let start = bytes.len();
    let payload = usize::from(shape.length_dw) * 4;
    let header = tlp.header_len();
    bytes.reserve(header + payload);
    bytes.resize(start + header, 0);
    tlp.emit_header(&mut bytes[start..]);
    bytes.resize(start + header + at, 0);
    bytes.extend_from_slice(data);
    bytes.resize(start + header + payload, 0);
    header + payload
}

/// TLPs of one [`send_mem_writes`] handed to the runtime at a time (16 KiB at a 4 KiB max payload
/// size).
const WRITE_BATCH: usize = 4;

/// Sends a memory write of `data` at `address` by `me` to `peer` on `channel`, split by `mps`:
/// each TLP encoded straight from `data` (what [`lanbus_pcie::request::write_requests`] builds) into a
/// buffer the sender queue takes as it is, handed over a few at a time, so that the runtime's
/// thread frames and transmits the first ones while this one encodes the rest.
pub(crate) fn send_mem_writes(
    sender: &Sender,
    peer: MacAddr,
    channel: u16,
    me: Bdf,
    address: u64,
    data: &[u8],
    mps: usize,
) -> Result<(), Error> {
    let chunks = split(address, data.len(), mps)?;
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    for c in &chunks {
        let mut tlp = Vec::new();
        let at = (c.address & 3) as usize;
        append_mem_write(&mut tlp, me, &c.shape(), at, &data[c.offset..c.offset + c.len]);
        batch.push(tlp);
        if batch.len() == WRITE_BATCH {
            sender.send_owned(peer, channel, batch.drain(..));
        }
    }
    sender.send_owned(peer, channel, batch);
    Ok(())
}

/// A read started by a function, in pieces of at most MRRS bytes.
struct Op {
    buf: Vec<u8>,
    todo: VecDeque<Chunk>,
    /// Tags in flight for this read.
    tags: Vec<u16>,
    error: Option<DmaError>,
    /// When the read fails unless it progresses (refreshed when one of its TLPs is sent or ends).
    deadline: Instant,
}

/// One read TLP in flight.
struct InTag {
    op: OpId,
    offset: usize,
    peer: MacAddr,
    asm: ReadReassembly,
}

/// The DMA reads of one function: split by max read request size into tagged MRd TLPs,
/// reassembled from their completions, failed when they stall. Sans-IO (the caller passes the
/// time and sends what `pump` emits); both paths use it, the inline one under the function's
/// mutex and a worker's under its function state's lock.
///
/// Invariants: a tag is either free or in `tags` (and then in its op's `tags`); a read ends (moves
/// to `finished`) once nothing of it is in flight and it is done or failed; every read not yet
/// ended has a deadline (`next_deadline`), also one that waits for tags, so none waits forever.
/// After anything frees tags (`complete`, `expire`, `fail_all`) the caller calls `pump`.
pub(crate) struct Reads {
    counters: Arc<Counters>,
    timeout: Duration,
    next_op: OpId,
    ops: BTreeMap<OpId, Op>,
    tags: HashMap<u16, InTag>,
    free_tags: Vec<u16>,
    finished: VecDeque<(OpId, Result<Vec<u8>, DmaError>)>,
    /// When a completion last arrived: a read waiting for tags is not stalled while the reads
    /// ahead of it progress.
    progress: Instant,
    /// A tag was freed or a read ended since `take_changed` (the worker wakes on it).
    changed: bool,
}

impl Reads {
    pub(crate) fn new(counters: Arc<Counters>, timeout: Duration, tags: u16) -> Reads {
        Reads {
            counters,
            timeout,
            next_op: 0,
            ops: BTreeMap::new(),
            tags: HashMap::new(),
            free_tags: (0..tags).rev().collect(),
            finished: VecDeque::new(),
            progress: Instant::now(),
            changed: false,
        }
    }

    /// Starts a read of `len` bytes at `address` in pieces of `mrrs` bytes; `pump` sends them.
    pub(crate) fn start(&mut self, address: u64, len: usize, mrrs: usize, now: Instant) -> OpId {
        let id = self.next_op;
        self.next_op += 1;
        bump(&self.counters.dma_reads);
        match split(address, len, mrrs) {
            Ok(chunks) => {
                let deadline = now + self.timeout;
                let op =
                    Op { buf: vec![0; len], todo: chunks.into(), tags: Vec::new(), error: None, deadline };
                self.ops.insert(id, op);
                self.settle(id);
            }
            Err(_) => {
                bump(&self.counters.dma_read_failures);
                self.finished.push_back((id, Err(DmaError::Completion(CplStatus::UnsupportedRequest))));
                self.changed = true;
            }
        }
        id
    }

    /// Hands `send` a read TLP (for `host`, from `me`) for the reads' pieces while tags are free,
    /// oldest read first; with no host, the reads' unsent pieces fail.
    pub(crate) fn pump(
        &mut self,
        host: Option<MacAddr>,
        me: Bdf,
        now: Instant,
        mut send: impl FnMut(MacAddr, &Tlp),
    ) {
        if self.free_tags.is_empty() || self.ops.values().all(|o| o.todo.is_empty() || o.error.is_some()) {
            return;
        }
        let Some(host) = host else {
            for o in self.ops.values_mut().filter(|o| !o.todo.is_empty()) {
                o.todo.clear();
                o.error.get_or_insert(DmaError::HostUnreachable);
            }
            self.settle_all();
            return;
        };
        let mut failed = false;
        'ops: for (id, o) in self.ops.iter_mut() {
            while o.error.is_none() && !o.todo.is_empty() {
                let Some(tag) = self.free_tags.pop() else { break 'ops };
                let c = o.todo.pop_front().expect("not empty");
                let asm = Tag::new(tag).and_then(|t| ReadReassembly::new(me, t, c.address, c.len).ok());
                let (Some(t), Some(asm)) = (Tag::new(tag), asm) else {
                    self.free_tags.push(tag);
                    o.error = Some(DmaError::Completion(CplStatus::UnsupportedRequest));
                    failed = true;
                    break;
                };
                let shape = c.shape();
                self.tags.insert(tag, InTag { op: *id, offset: c.offset, peer: host, asm });
                o.tags.push(tag);
                o.deadline = now + self.timeout;
                send(
                    host,
                    &Tlp::mem_read(me, t, shape.address, shape.length_dw, shape.first_be, shape.last_be),
                );
            }
        }
        if failed {
            self.settle_all();
        }
    }

    /// Moves read `id` to `finished` if nothing of it is in flight and it is done or failed.
    fn settle(&mut self, id: OpId) {
        let Some(o) = self.ops.get(&id) else { return };
        if !o.tags.is_empty() || !(o.todo.is_empty() || o.error.is_some()) {
            return;
        }
        let o = self.ops.remove(&id).expect("present");
        let result = match o.error {
            Some(e) => {
                bump(&self.counters.dma_read_failures);
                Err(e)
            }
            None => Ok(o.buf),
        };
        self.finished.push_back((id, result));
        self.changed = true;
    }

    fn settle_all(&mut self) {
        let ids: Vec<OpId> = self.ops.keys().copied().collect();
        for id in ids {
            self.settle(id);
        }
    }

    /// Ends read TLP `tag` (already out of the table) of read `op`, its piece at `offset`, with
    /// `result`.
    fn end(&mut self, tag: u16, op: OpId, offset: usize, result: Result<Vec<u8>, DmaError>, now: Instant) {
        self.free_tags.push(tag);
        self.changed = true;
        if let Some(o) = self.ops.get_mut(&op) {
            o.tags.retain(|t| *t != tag);
            o.deadline = now + self.timeout;
            match result {
                Ok(data) => {
                    if let Some(dst) = o.buf.get_mut(offset..offset + data.len()) {
                        dst.copy_from_slice(&data);
                    }
                }
                Err(e) => {
                    o.error.get_or_insert(e);
                    o.todo.clear();
                }
            }
        }
        self.settle(op);
    }

    /// Feeds a completion from `peer`; false if it matches no read in flight. The caller pumps.
    pub(crate) fn complete(&mut self, peer: MacAddr, tlp: &Tlp, now: Instant) -> bool {
        if !matches!(tlp.header, Header::Completion(_)) {
            return false;
        }
        let tag = tlp.tag.get();
        let Some(p) = self.tags.get_mut(&tag).filter(|p| p.peer == peer) else {
            return false;
        };
        let progress = match p.asm.handle_completion(tlp) {
            Ok(Progress::Partial) => {
                self.progress = now;
                return true;
            }
            Ok(Progress::Complete) => Ok(()),
            Err(Error::CompletionStatus(s)) => Err(DmaError::Completion(s)),
            Err(_) => return false,
        };
        self.progress = now;
        let p = self.tags.remove(&tag).expect("found above");
        let (op, offset) = (p.op, p.offset);
        let result = progress
            .and_then(|()| p.asm.into_data().map_err(|_| DmaError::Completion(CplStatus::CompleterAbort)));
        self.end(tag, op, offset, result, now);
        true
    }

    /// When read `o` fails unless it progresses: its own deadline while it has TLPs in flight;
    /// while it waits for tags, also not before the function's last completion plus the timeout.
    fn deadline_of(&self, o: &Op) -> Option<Instant> {
        if !o.tags.is_empty() {
            Some(o.deadline)
        } else if !o.todo.is_empty() && o.error.is_none() {
            Some(o.deadline.max(self.progress + self.timeout))
        } else {
            None
        }
    }

    /// Fails with [`DmaError::Timeout`] every read that made no progress within the completion
    /// timeout: its TLPs in flight and the pieces it has not sent. The caller pumps.
    pub(crate) fn expire(&mut self, now: Instant) {
        let expired: Vec<OpId> = self
            .ops
            .iter()
            .filter(|(_, o)| self.deadline_of(o).is_some_and(|d| d <= now))
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            let o = self.ops.get_mut(&id).expect("listed");
            o.todo.clear();
            o.error.get_or_insert(DmaError::Timeout);
            for tag in o.tags.drain(..) {
                self.tags.remove(&tag);
                self.free_tags.push(tag);
            }
            self.changed = true;
            self.settle(id);
        }
    }

    /// Fails every read with `error` (the host is gone).
    pub(crate) fn fail_all(&mut self, error: DmaError) {
        for (tag, _) in self.tags.drain() {
            self.free_tags.push(tag);
        }
        for o in self.ops.values_mut() {
            o.tags.clear();
            o.todo.clear();
            o.error.get_or_insert(error);
        }
        self.changed = true;
        self.settle_all();
    }

    /// The earliest deadline of a read not yet ended.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.ops.values().filter_map(|o| self.deadline_of(o)).min()
    }

    /// A finished read, if any.
    pub(crate) fn poll(&mut self) -> Option<(OpId, Result<Vec<u8>, DmaError>)> {
        self.finished.pop_front()
    }

    /// Read `op`'s result if it finished; `Some(Err(Timeout))` if no such read is known.
    pub(crate) fn take(&mut self, op: OpId) -> Option<Result<Vec<u8>, DmaError>> {
        match self.finished.iter().position(|(id, _)| *id == op) {
            Some(i) => Some(self.finished.remove(i).expect("found").1),
            None if !self.ops.contains_key(&op) => Some(Err(DmaError::Timeout)),
            None => None,
        }
    }

    /// Whether a tag was freed or a read ended since the last `take_changed`.
    pub(crate) fn changed(&self) -> bool {
        self.changed
    }

    pub(crate) fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }
}

/// The fabric path of an inline function.
pub(crate) struct InlinePath {
    /// The function's ID as its host addressed it.
    pub(crate) me: Bdf,
    /// The session snapshot the caller took: our host and its channel.
    pub(crate) host: Option<MacAddr>,
    pub(crate) channel: u16,
    pub(crate) out: TlpOut,
    counters: Arc<Counters>,
    reads: Reads,
    mps: usize,
    mrrs: usize,
}

impl InlinePath {
    pub(crate) fn new(
        me: Bdf,
        counters: Arc<Counters>,
        timeout: Duration,
        tags: u16,
        mps: usize,
        mrrs: usize,
    ) -> InlinePath {
        InlinePath {
            me,
            host: None,
            channel: 0,
            out: TlpOut::default(),
            reads: Reads::new(counters.clone(), timeout, tags),
            counters,
            mps,
            mrrs,
        }
    }

    /// Sends read TLPs for the reads' pieces while tags are free.
    fn pump(&mut self, now: Instant) {
        let (out, channel) = (&mut self.out, self.channel);
        self.reads.pump(self.host, self.me, now, |host, tlp| out.push(host, channel, tlp));
        self.reads.take_changed();
    }

    /// Feeds a completion from `peer`; false if it matches no read in flight.
    pub(crate) fn complete(&mut self, peer: MacAddr, tlp: &Tlp) -> bool {
        let now = Instant::now();
        let matched = self.reads.complete(peer, tlp, now);
        if matched {
            self.pump(now);
        }
        matched
    }

    /// Fails every read that made no progress within the completion timeout, and gives the tags
    /// they held to the reads that wait for them.
    pub(crate) fn expire(&mut self, now: Instant) {
        self.reads.expire(now);
        self.pump(now);
    }

    /// Fails every read: the host is gone.
    pub(crate) fn fail_all(&mut self) {
        self.reads.fail_all(DmaError::HostUnreachable);
    }

    /// The earliest deadline of a read not yet ended.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.reads.next_deadline()
    }
}

impl Path for InlinePath {
    fn start_read(&mut self, address: u64, len: usize) -> OpId {
        let now = Instant::now();
        let id = self.reads.start(address, len, self.mrrs, now);
        self.pump(now);
        id
    }

    fn write(&mut self, address: u64, data: &[u8]) -> Result<(), DmaError> {
        let Some(host) = self.host else {
            bump(&self.counters.dma_writes_dropped);
            return Err(DmaError::HostUnreachable);
        };
        let chunks = split(address, data.len(), self.mps)
            .map_err(|_| DmaError::Completion(CplStatus::UnsupportedRequest))?;
        bump(&self.counters.dma_writes);
        // What `write_requests` builds, encoded straight from `data` (no copy, no allocation per
        // TLP).
        for c in &chunks {
            let at = (c.address & 3) as usize;
            self.out.push_mem_write(
                host,
                self.channel,
                self.me,
                &c.shape(),
                at,
                &data[c.offset..c.offset + c.len],
            );
        }
        Ok(())
    }

    fn poll_read(&mut self) -> Option<(OpId, Result<Vec<u8>, DmaError>)> {
        self.reads.poll()
    }

    fn wait_read(&mut self, op: OpId) -> Result<Vec<u8>, DmaError> {
        // Only blocking models wait, and they run on a worker, never inline: a read that has not
        // finished cannot finish while the receive thread is here.
        self.reads.take(op).unwrap_or(Err(DmaError::Timeout))
    }

    fn set_limits(&mut self, mps: usize, mrrs: usize) {
        self.mps = mps;
        self.mrrs = mrrs;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanbus_pcie::request::write_requests;

    #[test]
    fn writes_encode_exactly_what_write_requests_builds() {
        let host = MacAddr([2, 0, 0, 0, 0, 9]);
        let me = Bdf::new(3, 0, 1).unwrap();
        let data: Vec<u8> = (0..9000u32).map(|i| (i * 7 + 3) as u8).collect();
        for mps in [128, 256, 512] {
            let mut path = InlinePath::new(me, Arc::default(), Duration::from_secs(1), 8, mps, 512);
            (path.host, path.channel) = (Some(host), 0x5005);
            for (address, len) in
                [(0x1000u64, 4096usize), (0x1_0000_0003, 1), (0x2ffd, 700), (0xfe, 9000), (0x40, 0)]
            {
                let want = write_requests(me, address, &data[..len], mps);
                let got = path.write(address, &data[..len]);
                let mut sent = Vec::new();
                path.out.drain(|p, c, b| sent.push((p, c, b.to_vec())));
                match want {
                    Ok(tlps) => {
                        assert!(got.is_ok());
                        let want: Vec<_> = tlps.iter().map(|t| (host, 0x5005, t.encode().unwrap())).collect();
                        assert_eq!(sent, want, "mps {mps} address {address:#x} len {len}");
                    }
                    Err(_) => assert!(got.is_err() && sent.is_empty(), "{address:#x} {len}"),
                }
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn push_mem_write_matches_write_requests_for_any_address_length_and_mps(
            address in proptest::prop_oneof![0u64..0x3000, (u32::MAX as u64 - 0x2000)..(u32::MAX as u64 + 0x2000), (u64::MAX - 0x3000)..u64::MAX],
            len in 0usize..9000,
            mps_log in 7u32..=12,
        ) {
            let mps = 1usize << mps_log;
            let host = MacAddr([2, 0, 0, 0, 0, 9]);
            let me = Bdf::new(3, 0, 1).unwrap();
            let data: Vec<u8> = (0..len as u32).map(|i| (i * 13 + 5) as u8).collect();
            let mut path = InlinePath::new(me, Arc::default(), Duration::from_secs(1), 8, mps, 512);
            (path.host, path.channel) = (Some(host), 7);
            let want = write_requests(me, address, &data, mps);
            let got = path.write(address, &data);
            let mut sent = Vec::new();
            path.out.drain(|p, c, b| sent.push((p, c, b.to_vec())));
            match want {
                Ok(tlps) => {
                    proptest::prop_assert!(got.is_ok());
                    let want: Vec<_> = tlps.iter().map(|t| (host, 7u16, t.encode().unwrap())).collect();
                    proptest::prop_assert_eq!(sent, want);
                }
                Err(_) => proptest::prop_assert!(got.is_err() && sent.is_empty()),
            }
        }
    }

    const HOST: MacAddr = MacAddr([2, 0, 0, 0, 0, 9]);
    const TIMEOUT: Duration = Duration::from_millis(100);

    fn me() -> Bdf {
        Bdf::new(3, 0, 1).unwrap()
    }

    /// An inline path with 256 tags and MRRS 512, its host set.
    fn path() -> InlinePath {
        let mut p = InlinePath::new(me(), Arc::default(), TIMEOUT, 256, 128, 512);
        (p.host, p.channel) = (Some(HOST), 0x5005);
        p
    }

    /// The read TLPs the path sent since the last call.
    fn sent(p: &mut InlinePath) -> Vec<Tlp> {
        let mut v = Vec::new();
        p.out.drain(|peer, _, b| {
            assert_eq!(peer, HOST);
            v.push(Tlp::decode(b).unwrap());
        });
        v
    }

    /// Answers `reads` as host memory holding `address as u8` at every address.
    fn answer(p: &mut InlinePath, reads: &[Tlp]) {
        for r in reads {
            let cpls = lanbus_pcie::request::completions_for_read(r, Bdf(0), 256, 64, |a, d| {
                for (i, b) in d.iter_mut().enumerate() {
                    *b = (a + i as u64) as u8;
                }
                Ok(())
            })
            .unwrap();
            for c in &cpls {
                assert!(p.complete(HOST, c));
            }
        }
    }

    fn finished(p: &mut InlinePath) -> Vec<(OpId, Result<Vec<u8>, DmaError>)> {
        std::iter::from_fn(|| p.poll_read()).collect()
    }

    #[test]
    fn a_read_waiting_for_tags_times_out_after_a_stall_instead_of_hanging() {
        let mut p = path();
        // 1 MiB at MRRS 512: 2048 pieces, every tag in flight; the second read waits for tags.
        let a = p.start_read(0x10_0000, 1 << 20);
        assert_eq!(sent(&mut p).len(), 256);
        let b = p.start_read(0x20_0000, 4096);
        assert!(sent(&mut p).is_empty(), "no tag left");
        let deadline = p.next_deadline().expect("reads pending");
        // The host stalls past the completion timeout: both reads end, neither hangs.
        p.expire(deadline.max(Instant::now() + TIMEOUT) + Duration::from_millis(1));
        let done = finished(&mut p);
        assert_eq!(done, vec![(a, Err(DmaError::Timeout)), (b, Err(DmaError::Timeout))]);
        assert_eq!(p.next_deadline(), None);
        // Every tag is free again.
        let c = p.start_read(0x30_0000, 256 * 512);
        let reads = sent(&mut p);
        assert_eq!(reads.len(), 256);
        answer(&mut p, &reads);
        let done = finished(&mut p);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].0, c);
        let want: Vec<u8> = (0..256 * 512u64).map(|i| (0x30_0000 + i) as u8).collect();
        assert_eq!(done[0].1.as_deref(), Ok(&want[..]));
    }

    #[test]
    fn tags_a_timeout_frees_go_to_the_read_waiting_for_them() {
        let mut p = path();
        let a = p.start_read(0x10_0000, 1 << 20);
        let started = Instant::now();
        assert_eq!(sent(&mut p).len(), 256);
        std::thread::sleep(Duration::from_millis(20));
        // Started 20 ms later: it has not waited a whole timeout when the first read expires.
        let b = p.start_read(0x20_0000, 4096);
        assert!(sent(&mut p).is_empty());
        p.expire(started + TIMEOUT + Duration::from_millis(1));
        assert_eq!(finished(&mut p), vec![(a, Err(DmaError::Timeout))]);
        // The freed tags went to the waiting read at once.
        let reads = sent(&mut p);
        assert_eq!(reads.len(), 8);
        assert!(p.next_deadline().is_some());
        answer(&mut p, &reads);
        let want: Vec<u8> = (0..4096u64).map(|i| (0x20_0000 + i) as u8).collect();
        assert_eq!(finished(&mut p), vec![(b, Ok(want))]);
    }

    #[test]
    fn a_read_waiting_for_tags_lives_while_the_reads_ahead_progress() {
        let mut p = path();
        let _a = p.start_read(0x10_0000, 1 << 20);
        let first = sent(&mut p);
        let b = p.start_read(0x20_0000, 4096);
        // The first read progresses (one piece answered) just before the second read has waited
        // a whole timeout: the second one is not failed for waiting.
        std::thread::sleep(TIMEOUT - Duration::from_millis(20));
        answer(&mut p, &first[..1]);
        let more = sent(&mut p);
        assert_eq!(more.len(), 1, "the freed tag went to the first read's next piece");
        p.expire(Instant::now() + Duration::from_millis(40));
        assert!(finished(&mut p).is_empty(), "nothing failed");
        // It keeps a deadline: a stall from here fails it too.
        p.expire(Instant::now() + TIMEOUT * 2);
        let done = finished(&mut p);
        assert!(done.iter().any(|(id, r)| *id == b && *r == Err(DmaError::Timeout)), "{done:?}");
    }
}
