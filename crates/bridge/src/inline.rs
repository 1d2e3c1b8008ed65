//! Sans-IO device models run inline, on the device runtime's receive thread.
//!
//! Layer: pcie engine, device side. A [`HostedFunction::model`](super::HostedFunction::model)
//! never blocks, so the device bridge serves its configuration and memory requests, feeds its DMA
//! read completions and runs it right where the TLPs arrive; the TLPs it sends (completions, DMA
//! reads and writes, MSI-X) collect in a [`TlpOut`] that the caller flushes into the runtime's
//! outbox (no worker thread, no queue, no wake-up per TLP). [`InlinePath`] is the fabric [`Path`]
//! of such a function: its DMA reads go through [`Reads`] (the PCIe crate's requester, which a
//! blocking function's worker path uses too); posted writes are split by max payload size and
//! encoded straight from the model's bytes.
//!
//! Invariant: everything here runs under the function's mutex; the caller takes the session
//! snapshot (host, channel) under the session lock and holds that lock while the function uses
//! it (lock order: session, then function), so the session lock is never taken inside and a
//! host lost meanwhile is never put back. Only the receive thread sends the function's output.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lanbus_runtime::{Outbox, Sender};
use lanbus_transport::{Gathered, LentSlice};
use lanbus_wire::MacAddr;

use crate::counters::{bump, Counters};
use crate::hosted::{OpId, Path};
use crate::reads::Reads;
use lanbus_pcie::device::DmaError;
use lanbus_pcie::request::{split, Chunk, RequestShape};
use lanbus_pcie::{Bdf, CplStatus, Error, Tlp};

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
    let start = bytes.len();
    let payload = usize::from(shape.length_dw) * 4;
    let header = append_mem_write_header(bytes, me, shape, payload);
    bytes.resize(start + header + at, 0);
    bytes.extend_from_slice(data);
    bytes.resize(start + header + payload, 0);
    header + payload
}

/// Appends to `bytes` the header of a memory write by `me` with `shape`, reserving room for
/// `room` bytes after it. Returns the header's length.
fn append_mem_write_header(bytes: &mut Vec<u8>, me: Bdf, shape: &RequestShape, room: usize) -> usize {
    let mut tlp = Tlp::mem_write(me, shape.address, shape.first_be, shape.last_be, Vec::new());
    tlp.length_dw = shape.length_dw;
    let start = bytes.len();
    let header = tlp.header_len();
    bytes.reserve(header + room);
    bytes.resize(start + header, 0);
    tlp.emit_header(&mut bytes[start..]);
    header
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

/// [`send_mem_writes`] for data the caller shares rather than lends for the call: each TLP's
/// header goes to the runtime with its slice of `data`, which the runtime's thread copies
/// straight into the transport's frames (one copy of each byte in user space, on that thread).
pub(crate) fn send_mem_writes_shared(
    sender: &Sender,
    peer: MacAddr,
    channel: u16,
    me: Bdf,
    address: u64,
    data: &LentSlice,
    mps: usize,
) -> Result<(), Error> {
    let chunks = split(address, data.len(), mps)?;
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    for c in &chunks {
        batch.push(shared_mem_write(me, c, data));
        if batch.len() == WRITE_BATCH {
            sender.send_shared(peer, channel, batch.drain(..));
        }
    }
    sender.send_shared(peer, channel, batch);
    Ok(())
}

/// The memory write TLP of piece `c` of `data` by `me`, as [`Sender::send_shared`] takes it: its
/// header and the `at` zero bytes up to the first byte enabled, its slice of `data`, and the
/// zeros to its last DW.
fn shared_mem_write(me: Bdf, c: &Chunk, data: &LentSlice) -> (Vec<u8>, LentSlice, usize) {
    let shape = c.shape();
    let (at, payload) = ((c.address & 3) as usize, usize::from(shape.length_dw) * 4);
    let mut head = Vec::new();
    let header = append_mem_write_header(&mut head, me, &shape, 0);
    head.resize(header + at, 0);
    (head, data.slice(c.offset..c.offset + c.len), payload - at - c.len)
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
    /// Reads a blocking function's posted-only work said it will ask for (see
    /// [`InlinePath::take_prefetches`]).
    prefetches: Vec<(u64, usize)>,
    /// Prefetches that ended, (address, length, data), for that work to read (see
    /// [`InlinePath::set_ready`]).
    ready: Vec<(u64, usize, Vec<u8>)>,
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
            prefetches: Vec::new(),
            ready: Vec::new(),
        }
    }

    /// The reads (address, length) prefetched through this path since the last call, and the
    /// max read request size to split them by. This path serves a blocking function's posted
    /// work on the receive thread; the reads belong to the function's worker, whose [`Reads`]
    /// the caller starts them on.
    pub(crate) fn take_prefetches(&mut self) -> (Vec<(u64, usize)>, usize) {
        (std::mem::take(&mut self.prefetches), self.mrrs)
    }

    /// Hands the prefetches that ended (taken from the worker's reads) to the posted-only work
    /// about to run through this path; what it does not read is dropped with the next call.
    pub(crate) fn set_ready(&mut self, ready: Vec<(u64, usize, Vec<u8>)>) {
        self.ready = ready;
    }

    /// Sends read TLPs for the reads' pieces while tags are free.
    fn pump(&mut self, now: Instant) {
        let (out, channel) = (&mut self.out, self.channel);
        self.reads.pump(self.host, self.me, now, |host, tlp| out.push(host, channel, tlp));
        self.reads.take_changed();
    }

    /// Feeds a completion from `peer`; false if it matches no read in flight.
    pub(crate) fn complete(&mut self, peer: MacAddr, tlp: &Tlp, payload: &[u8]) -> bool {
        let now = Instant::now();
        let matched = self.reads.complete(peer, tlp, payload, now);
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

    /// The host and the TLPs (as chunks of the data) of a posted write of `len` bytes at
    /// `address`, counted; an error (counted) when there is no host or the range cannot be
    /// written.
    fn write_chunks(&self, address: u64, len: usize) -> Result<(MacAddr, Vec<Chunk>), DmaError> {
        let Some(host) = self.host else {
            bump(&self.counters.dma_writes_dropped);
            return Err(DmaError::HostUnreachable);
        };
        let chunks =
            split(address, len, self.mps).map_err(|_| DmaError::Completion(CplStatus::UnsupportedRequest))?;
        bump(&self.counters.dma_writes);
        Ok((host, chunks))
    }

    /// A posted write as [`Path::write`] makes it, sent straight to `out`: what waits in the
    /// arena goes first (a function's TLPs leave in the order it made them), then each TLP's
    /// header and payload are appended to the transport's frame from `data`, so each byte is
    /// copied once on its way out instead of twice (into the arena, then into the frame).
    pub(crate) fn write_direct(
        &mut self,
        out: &mut dyn Outbox,
        address: u64,
        data: &[u8],
    ) -> Result<(), DmaError> {
        self.out.drain(|peer, channel, bytes| out.send(peer, channel, bytes));
        let (host, chunks) = self.write_chunks(address, data.len())?;
        let mut header = [0u8; 16];
        for c in &chunks {
            let shape = c.shape();
            let mut tlp = Tlp::mem_write(self.me, shape.address, shape.first_be, shape.last_be, Vec::new());
            tlp.length_dw = shape.length_dw;
            let h = tlp.emit_header(&mut header);
            // The payload: zero bytes up to the first byte enabled, the data, zeros to the last DW.
            let at = (c.address & 3) as usize;
            let mut source = Gathered {
                head: &header[..h],
                gap: at,
                body: &data[c.offset..c.offset + c.len],
                tail: usize::from(shape.length_dw) * 4 - at - c.len,
            };
            out.send_from(host, self.channel, &mut source);
        }
        Ok(())
    }

    /// The earliest deadline of a read not yet ended, or the end of a tag's quarantine.
    pub(crate) fn next_deadline(&mut self) -> Option<Instant> {
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
        let (host, chunks) = self.write_chunks(address, data.len())?;
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

    fn prefetch(&mut self, address: u64, len: usize) {
        self.prefetches.push((address, len));
    }

    fn read_ready(&mut self, address: u64, len: usize) -> Option<Vec<u8>> {
        let i = self.ready.iter().position(|&(a, n, _)| (a, n) == (address, len))?;
        bump(&self.counters.prefetches_used);
        Some(self.ready.swap_remove(i).2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanbus_pcie::request::write_requests;
    use lanbus_transport::MessageSource;

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

    /// An outbox that records each message, taking a [`MessageSource`]'s bytes in pieces of
    /// `piece` bytes, as the transport does across frames.
    struct Recording {
        piece: usize,
        sent: Vec<(MacAddr, u16, Vec<u8>)>,
    }

    impl Outbox for Recording {
        fn send(&mut self, peer: MacAddr, channel: u16, data: &[u8]) {
            self.sent.push((peer, channel, data.to_vec()));
        }

        fn send_from(&mut self, peer: MacAddr, channel: u16, data: &mut dyn MessageSource) {
            let mut v = Vec::new();
            let mut at = 0;
            while at < data.len() {
                let n = self.piece.min(data.len() - at);
                data.append_to(&mut v, at, n);
                at += n;
            }
            self.sent.push((peer, channel, v));
        }
    }

    /// What `write_direct` sends for a write of `data` at `address`, a read's TLP having waited in
    /// the arena before it; `None` when the write was refused.
    fn direct_writes(
        address: u64,
        data: &[u8],
        mps: usize,
        piece: usize,
    ) -> Option<Vec<(MacAddr, u16, Vec<u8>)>> {
        let host = MacAddr([2, 0, 0, 0, 0, 9]);
        let me = Bdf::new(3, 0, 1).unwrap();
        let mut path = InlinePath::new(me, Arc::default(), Duration::from_secs(1), 8, mps, 512);
        (path.host, path.channel) = (Some(host), 7);
        let read = Tlp::mem_read(me, lanbus_pcie::Tag::new(1).unwrap(), 0x8000, 4, 0xf, 0xf);
        path.out.push(host, 7, &read);
        let mut out = Recording { piece, sent: Vec::new() };
        let got = path.write_direct(&mut out, address, data);
        let (first, rest) = out.sent.split_first()?;
        assert_eq!(first, &(host, 7, read.encode().unwrap()), "the arena's TLP first");
        got.is_ok().then(|| rest.to_vec())
    }

    #[test]
    fn direct_writes_send_exactly_what_write_requests_builds() {
        let me = Bdf::new(3, 0, 1).unwrap();
        let host = MacAddr([2, 0, 0, 0, 0, 9]);
        let data: Vec<u8> = (0..9000u32).map(|i| (i * 7 + 3) as u8).collect();
        for (mps, piece) in [(128, 1), (256, 7), (512, 64), (4096, 1500)] {
            for (address, len) in [(0x1000u64, 4096usize), (0x1_0000_0003, 1), (0x2ffd, 700), (0xfe, 9000)] {
                let want = write_requests(me, address, &data[..len], mps).unwrap();
                let want: Vec<_> = want.iter().map(|t| (host, 7u16, t.encode().unwrap())).collect();
                let got = direct_writes(address, &data[..len], mps, piece);
                assert_eq!(got, Some(want), "mps {mps} piece {piece} address {address:#x} len {len}");
            }
        }
        // A write across the top of the address space is refused, after what waited was sent.
        assert_eq!(direct_writes(u64::MAX - 3, &data[..64], 128, 64), None);
    }

    proptest::proptest! {
        #[test]
        fn direct_writes_match_write_requests_for_any_address_length_mps_and_frame_piece(
            address in proptest::prop_oneof![0u64..0x3000, (u32::MAX as u64 - 0x2000)..(u32::MAX as u64 + 0x2000), (u64::MAX - 0x3000)..u64::MAX],
            len in 0usize..9000,
            mps_log in 7u32..=12,
            piece in 1usize..5000,
        ) {
            let mps = 1usize << mps_log;
            let host = MacAddr([2, 0, 0, 0, 0, 9]);
            let me = Bdf::new(3, 0, 1).unwrap();
            let data: Vec<u8> = (0..len as u32).map(|i| (i * 13 + 5) as u8).collect();
            let got = direct_writes(address, &data, mps, piece);
            match write_requests(me, address, &data, mps) {
                Ok(tlps) => {
                    let want: Vec<_> = tlps.iter().map(|t| (host, 7u16, t.encode().unwrap())).collect();
                    proptest::prop_assert_eq!(got, Some(want));
                }
                Err(_) => proptest::prop_assert_eq!(got, None),
            }
        }

        #[test]
        fn shared_mem_writes_match_write_requests_for_any_address_length_and_mps(
            address in proptest::prop_oneof![0u64..0x3000, (u32::MAX as u64 - 0x2000)..(u32::MAX as u64 + 0x2000), (u64::MAX - 0x3000)..u64::MAX],
            skip in 0usize..64,
            len in 0usize..9000,
            mps_log in 7u32..=12,
        ) {
            let mps = 1usize << mps_log;
            let me = Bdf::new(3, 0, 1).unwrap();
            // The data a slice of a larger buffer, as a pipelined write's pieces are.
            let buffer: Arc<Vec<u8>> = Arc::new((0..(skip + len + 17) as u32).map(|i| (i * 13 + 5) as u8).collect());
            let data = LentSlice::new(buffer.clone(), skip..skip + len);
            match (write_requests(me, address, &buffer[skip..skip + len], mps), split(address, len, mps)) {
                (Ok(tlps), Ok(chunks)) => {
                    let got: Vec<Vec<u8>> = chunks
                        .iter()
                        .map(|c| {
                            let (head, body, zeros) = shared_mem_write(me, c, &data);
                            [head.as_slice(), body.bytes(), &vec![0; zeros]].concat()
                        })
                        .collect();
                    let want: Vec<Vec<u8>> = tlps.iter().map(|t| t.encode().unwrap()).collect();
                    proptest::prop_assert_eq!(got, want);
                }
                (Err(_), Err(_)) => {}
                (w, c) => proptest::prop_assert!(false, "write_requests {:?}, split {:?}", w.is_ok(), c.is_ok()),
            }
        }

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
}
