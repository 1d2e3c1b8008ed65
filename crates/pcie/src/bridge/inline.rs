//! Sans-IO device models run inline, on the device runtime's receive thread.
//!
//! Layer: pcie engine, device side. A [`HostedFunction::model`](super::HostedFunction::model)
//! never blocks, so the device bridge serves its configuration and memory requests, feeds its DMA
//! read completions and runs it right where the TLPs arrive; the TLPs it sends (completions, DMA
//! reads and writes, MSI-X) collect in a [`TlpOut`] that the caller flushes into the runtime's
//! outbox (no worker thread, no queue, no wake-up per TLP). [`InlinePath`] is the fabric [`Path`]
//! of such a function: tagged reads split by max read request size, reassembled from their
//! completions; posted writes split by max payload size.
//!
//! Invariant: everything here runs under the function's mutex; the caller snapshots the session
//! (host, channel) before taking it, so the session lock is never taken inside (lock order:
//! session, then function).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanbus_wire::MacAddr;

use super::device::{bump, Counters};
use super::hosted::{OpId, Path};
use crate::device::DmaError;
use crate::request::{split, Chunk};
use crate::{Bdf, CplStatus, Error, Header, Progress, ReadReassembly, Tag, Tlp};

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

/// A read started by the function, in pieces of at most MRRS bytes.
struct Op {
    buf: Vec<u8>,
    todo: VecDeque<Chunk>,
    /// Tags in flight for this read.
    tags: Vec<u16>,
    error: Option<DmaError>,
    /// When the read fails unless it progresses.
    deadline: Instant,
}

/// One read TLP in flight.
struct InTag {
    op: OpId,
    offset: usize,
    peer: MacAddr,
    asm: ReadReassembly,
}

/// The fabric path of an inline function.
pub(crate) struct InlinePath {
    /// The function's ID as its host addressed it.
    pub(crate) me: Bdf,
    /// The session snapshot the caller took: our host and its channel.
    pub(crate) host: Option<MacAddr>,
    pub(crate) channel: u16,
    pub(crate) out: TlpOut,
    /// The payload buffer of the writes being encoded (reused).
    payload: Vec<u8>,
    counters: Arc<Counters>,
    timeout: Duration,
    next_op: OpId,
    ops: BTreeMap<OpId, Op>,
    reads: HashMap<u16, InTag>,
    free_tags: Vec<u16>,
    finished: VecDeque<(OpId, Result<Vec<u8>, DmaError>)>,
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
            payload: Vec::new(),
            counters,
            timeout,
            next_op: 0,
            ops: BTreeMap::new(),
            reads: HashMap::new(),
            free_tags: (0..tags).rev().collect(),
            finished: VecDeque::new(),
            mps,
            mrrs,
        }
    }

    /// Sends read TLPs for the reads' pieces while tags are free.
    fn pump(&mut self) {
        if self.ops.values().all(|o| o.todo.is_empty()) {
            return;
        }
        let now = Instant::now();
        let Some(host) = self.host else {
            for o in self.ops.values_mut().filter(|o| !o.todo.is_empty()) {
                o.todo.clear();
                o.error.get_or_insert(DmaError::HostUnreachable);
            }
            self.settle_all();
            return;
        };
        let me = self.me;
        let mut failed = false;
        'ops: for (id, o) in self.ops.iter_mut() {
            while o.error.is_none() && !o.todo.is_empty() {
                let Some(tag) = self.free_tags.pop() else { break 'ops };
                let Some(t) = Tag::new(tag) else { continue };
                let c = o.todo.pop_front().expect("not empty");
                let Ok(asm) = ReadReassembly::new(me, t, c.address, c.len) else {
                    self.free_tags.push(tag);
                    o.error = Some(DmaError::Completion(CplStatus::UnsupportedRequest));
                    failed = true;
                    break;
                };
                let shape = c.shape();
                self.reads.insert(tag, InTag { op: *id, offset: c.offset, peer: host, asm });
                o.tags.push(tag);
                o.deadline = now + self.timeout;
                let tlp = Tlp::mem_read(me, t, shape.address, shape.length_dw, shape.first_be, shape.last_be);
                self.out.push(host, self.channel, &tlp);
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
    }

    fn settle_all(&mut self) {
        let ids: Vec<OpId> = self.ops.keys().copied().collect();
        for id in ids {
            self.settle(id);
        }
    }

    /// Ends tag `tag` of its read with `result` (data for the piece, or why it failed).
    fn end_tag(&mut self, tag: u16, result: Result<Vec<u8>, DmaError>, now: Instant) {
        if let Some(p) = self.reads.remove(&tag) {
            self.end(tag, p.op, p.offset, result, now);
        }
    }

    /// Ends read TLP `tag` (already out of the table) of read `op`, its piece at `offset`, with
    /// `result`.
    fn end(&mut self, tag: u16, op: OpId, offset: usize, result: Result<Vec<u8>, DmaError>, now: Instant) {
        self.free_tags.push(tag);
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
                }
            }
        }
        self.settle(op);
    }

    /// Feeds a completion from `peer`; false if it matches no read in flight.
    pub(crate) fn complete(&mut self, peer: MacAddr, tlp: &Tlp) -> bool {
        if !matches!(tlp.header, Header::Completion(_)) {
            return false;
        }
        let tag = tlp.tag.get();
        let Some(p) = self.reads.get_mut(&tag).filter(|p| p.peer == peer) else {
            return false;
        };
        let progress = match p.asm.handle_completion(tlp) {
            Ok(Progress::Partial) => return true,
            Ok(Progress::Complete) => Ok(()),
            Err(Error::CompletionStatus(s)) => Err(DmaError::Completion(s)),
            Err(_) => return false,
        };
        let p = self.reads.remove(&tag).expect("found above");
        let (op, offset) = (p.op, p.offset);
        let result = progress
            .and_then(|()| p.asm.into_data().map_err(|_| DmaError::Completion(CplStatus::CompleterAbort)));
        self.end(tag, op, offset, result, Instant::now());
        self.pump();
        true
    }

    /// Fails every read that made no progress within the completion timeout.
    pub(crate) fn expire(&mut self, now: Instant) {
        let expired: Vec<u16> = self
            .ops
            .values()
            .filter(|o| !o.tags.is_empty() && o.deadline <= now)
            .flat_map(|o| o.tags.iter().copied())
            .collect();
        for tag in expired {
            self.end_tag(tag, Err(DmaError::Timeout), now);
        }
    }

    /// Fails every read in flight: the host is gone.
    pub(crate) fn fail_all(&mut self) {
        let tags: Vec<u16> = self.reads.keys().copied().collect();
        let now = Instant::now();
        for tag in tags {
            self.end_tag(tag, Err(DmaError::HostUnreachable), now);
        }
        for o in self.ops.values_mut() {
            if !o.todo.is_empty() {
                o.todo.clear();
                o.error.get_or_insert(DmaError::HostUnreachable);
            }
        }
        self.settle_all();
    }

    /// The earliest deadline of a read in flight.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.ops.values().filter(|o| !o.tags.is_empty()).map(|o| o.deadline).min()
    }
}

impl Path for InlinePath {
    fn start_read(&mut self, address: u64, len: usize) -> OpId {
        let id = self.next_op;
        self.next_op += 1;
        bump(&self.counters.dma_reads);
        match split(address, len, self.mrrs) {
            Ok(chunks) => {
                let deadline = Instant::now() + self.timeout;
                let op =
                    Op { buf: vec![0; len], todo: chunks.into(), tags: Vec::new(), error: None, deadline };
                self.ops.insert(id, op);
                self.pump();
                self.settle(id);
            }
            Err(_) => {
                bump(&self.counters.dma_read_failures);
                self.finished.push_back((id, Err(DmaError::Completion(CplStatus::UnsupportedRequest))));
            }
        }
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
        // What `write_requests` builds, one TLP at a time through one reused payload buffer (no
        // allocation per TLP).
        let mut payload = std::mem::take(&mut self.payload);
        for c in &chunks {
            let shape = c.shape();
            payload.clear();
            payload.resize(usize::from(shape.length_dw) * 4, 0);
            let at = (c.address & 3) as usize;
            payload[at..at + c.len].copy_from_slice(&data[c.offset..c.offset + c.len]);
            let tlp = Tlp::mem_write(self.me, shape.address, shape.first_be, shape.last_be, payload);
            self.out.push(host, self.channel, &tlp);
            payload = tlp.data;
        }
        self.payload = payload;
        Ok(())
    }

    fn poll_read(&mut self) -> Option<(OpId, Result<Vec<u8>, DmaError>)> {
        self.finished.pop_front()
    }

    fn wait_read(&mut self, op: OpId) -> Result<Vec<u8>, DmaError> {
        // Only blocking models wait, and they run on a worker, never inline: a read that has not
        // finished cannot finish while the receive thread is here.
        match self.finished.iter().position(|(id, _)| *id == op) {
            Some(i) => self.finished.remove(i).expect("found").1,
            None => Err(DmaError::Timeout),
        }
    }

    fn set_limits(&mut self, mps: usize, mrrs: usize) {
        self.mps = mps;
        self.mrrs = mrrs;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::write_requests;

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
}
