//! The DMA reads of one device function: the PCIe crate's [`Requester`] driven with the device
//! bridge's clock, toward the function's host.
//!
//! Layer: bridges, device side. Sans-IO in all but the clock: the caller passes `now` and sends
//! what [`Reads::pump`] hands it; the inline path uses it under the function's mutex, a blocking
//! function's worker under its function state's lock. Splitting, tags (with their quarantine),
//! reassembly and the completion timeout are the requester's; this adapter maps its transactions
//! to the model's [`OpId`]s and its errors to [`DmaError`]s, and counts.
//!
//! A read may be started ahead of the worker's asking ([`Reads::prefetch`], from the receive
//! thread, when a blocking model's posted-only work names a read it or the next run will make).
//! When it ends, the receive thread's next run of that work takes it
//! ([`Reads::take_ready_prefetches`]); otherwise the worker's read of exactly that range claims
//! it ([`Reads::claim`]) instead of starting its own; a read of anything overlapping it, or the
//! end of the worker's run, drops it. So a
//! prefetched result is used at most once and never outlives the run it was made for, and memory
//! read again after the model used it (a queue slot the host filled anew) is read anew.
//!
//! Invariants: every read started ends once, in [`Reads::poll`] or [`Reads::take`] (a dropped
//! prefetch: in neither, its result thrown away); completions are accepted only from the host
//! the reads went to; after anything that may free a tag (`complete`, `expire`) the caller calls
//! `pump`.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanbus_pcie::device::DmaError;
use lanbus_pcie::requester::{Requester, RequesterEvent, TransactionMap};
use lanbus_pcie::{Bdf, CplStatus, Error, Tlp};
use lanbus_wire::MacAddr;

use crate::counters::{add, bump, Counters};
use crate::hosted::OpId;

/// The largest read request a function may be programmed with (PCIe's maximum).
const MRRS_MAX: usize = 4096;

/// Prefetched reads kept unclaimed at most (the oldest goes first): a drive names reads for
/// the commands queued behind the one that waits, up to 24 of them, and its own.
const PREFETCH_MAX: usize = 64;

/// One function's DMA reads. See the module docs.
pub(crate) struct Reads {
    counters: Arc<Counters>,
    requester: Requester,
    /// The requester's time zero.
    origin: Instant,
    /// The host the reads in flight were sent to.
    host: Option<MacAddr>,
    ops: TransactionMap<OpId>,
    next_op: OpId,
    finished: VecDeque<(OpId, Result<Vec<u8>, DmaError>)>,
    /// A tag a waiting request needs was freed, or a read ended, since `take_changed` (the worker
    /// wakes on it).
    changed: bool,
    /// The one read the worker sleeps for, if it sleeps for one: others that end meanwhile do
    /// not wake it (it takes them when it asks for them).
    awaiting: Option<OpId>,
    /// Prefetched reads nobody claimed yet: (address, length, op), oldest first.
    prefetched: Vec<(u64, usize, OpId)>,
    /// Dropped prefetches still in flight: their results are thrown away when they end.
    discarded: HashSet<OpId>,
    /// A tag a queued request needs was freed since the last `pump` (see [`Reads::tag_freed`]).
    tag_freed: bool,
}

impl Reads {
    pub(crate) fn new(counters: Arc<Counters>, timeout: Duration, tags: u16) -> Reads {
        Reads {
            counters,
            requester: Requester::new(Bdf(0), tags, timeout, MRRS_MAX).expect("4096 is a valid size"),
            origin: Instant::now(),
            host: None,
            ops: TransactionMap::default(),
            next_op: 0,
            finished: VecDeque::new(),
            changed: false,
            awaiting: None,
            prefetched: Vec::new(),
            discarded: HashSet::new(),
            tag_freed: false,
        }
    }

    /// `now` on the requester's clock.
    fn at(&self, now: Instant) -> lanbus_wire::time::Instant {
        let since = now.saturating_duration_since(self.origin);
        lanbus_wire::time::Instant::from_nanos(u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
    }

    /// Starts a read of `len` bytes at `address` in pieces of `mrrs` bytes; `pump` sends them.
    pub(crate) fn start(&mut self, address: u64, len: usize, mrrs: usize, now: Instant) -> OpId {
        let op = self.next_op;
        self.next_op += 1;
        bump(&self.counters.dma_reads);
        let at = self.at(now);
        let started =
            self.requester.set_max_read_request(mrrs).and_then(|()| self.requester.read(at, address, len));
        match started {
            Ok(id) => {
                self.ops.insert(id, op);
            }
            Err(_) => self.end(op, Err(DmaError::Completion(CplStatus::UnsupportedRequest))),
        }
        op
    }

    /// Starts a read of `len` bytes at `address` that the worker will ask for soon (see the
    /// module docs); `pump` sends it. An unclaimed prefetch of the same range stands (nothing
    /// consumed that memory since); one that overlaps it is dropped.
    pub(crate) fn prefetch(&mut self, address: u64, len: usize, mrrs: usize, now: Instant) {
        if len == 0 || self.prefetched.iter().any(|&(a, n, _)| (a, n) == (address, len)) {
            return;
        }
        self.drop_prefetches_over(address, len);
        if self.prefetched.len() >= PREFETCH_MAX {
            let (_, _, op) = self.prefetched.remove(0);
            self.discard(op);
        }
        bump(&self.counters.prefetched_reads);
        let op = self.start(address, len, mrrs, now);
        // A read that could not start has ended already (in `finished`, with its error).
        self.prefetched.push((address, len, op));
    }

    /// The prefetched read of exactly `len` bytes at `address`, now the caller's to `take`;
    /// `None` if there is none (prefetches overlapping the range are then dropped: the caller
    /// reads that memory itself).
    pub(crate) fn claim(&mut self, address: u64, len: usize) -> Option<OpId> {
        if self.prefetched.is_empty() {
            return None;
        }
        match self.prefetched.iter().position(|&(a, n, _)| (a, n) == (address, len)) {
            Some(i) => {
                let (_, _, op) = self.prefetched.remove(i);
                bump(&self.counters.prefetches_used);
                // From here on an ordinary read: its end wakes a worker that waits for it.
                Some(op)
            }
            None => {
                self.drop_prefetches_over(address, len);
                None
            }
        }
    }

    /// Whether a prefetch is still on its way.
    pub(crate) fn prefetch_in_flight(&self) -> bool {
        self.prefetched.iter().any(|&(_, _, op)| !self.finished.iter().any(|(id, _)| *id == op))
    }

    /// Whether a prefetch ended well and waits for its claim.
    pub(crate) fn prefetch_ready(&self) -> bool {
        self.prefetched.iter().any(|&(_, _, op)| self.finished.iter().any(|(id, r)| *id == op && r.is_ok()))
    }

    /// Claims every prefetch that ended well, as (address, length, data): the receive thread's
    /// run of the model's posted-only work reads them. Failed ones stay for the worker's claim.
    pub(crate) fn take_ready_prefetches(&mut self) -> Vec<(u64, usize, Vec<u8>)> {
        let mut ready = Vec::new();
        let mut i = 0;
        while i < self.prefetched.len() {
            let (address, len, op) = self.prefetched[i];
            match self.finished.iter().position(|(id, r)| *id == op && r.is_ok()) {
                Some(at) => {
                    self.prefetched.remove(i);
                    if let Some((_, Ok(data))) = self.finished.remove(at) {
                        ready.push((address, len, data));
                    }
                }
                None => i += 1,
            }
        }
        ready
    }

    /// Drops every unclaimed prefetch (the worker's run that could have used them is over).
    pub(crate) fn drop_prefetches(&mut self) {
        for (_, _, op) in std::mem::take(&mut self.prefetched) {
            self.discard(op);
        }
    }

    /// Drops the unclaimed prefetches that overlap `len` bytes at `address`.
    fn drop_prefetches_over(&mut self, address: u64, len: usize) {
        let end = address.saturating_add(len as u64);
        let mut i = 0;
        while i < self.prefetched.len() {
            let (a, n, op) = self.prefetched[i];
            if a < end && address < a.saturating_add(n as u64) {
                self.prefetched.remove(i);
                self.discard(op);
            } else {
                i += 1;
            }
        }
    }

    /// Forgets read `op`: its result if it ended, or the result it will end with.
    fn discard(&mut self, op: OpId) {
        match self.finished.iter().position(|(id, _)| *id == op) {
            Some(i) => {
                self.finished.remove(i);
            }
            None => {
                self.discarded.insert(op);
            }
        }
    }

    /// Hands `send` the read TLPs (for `host`, from `me`) that tags allow, oldest read first; with
    /// no host, or another host than the reads in flight went to, those reads fail.
    pub(crate) fn pump(
        &mut self,
        host: Option<MacAddr>,
        me: Bdf,
        now: Instant,
        mut send: impl FnMut(MacAddr, &Tlp),
    ) {
        let at = self.at(now);
        let lost = match (self.host, host) {
            (_, None) => Some("no host"),
            (Some(old), Some(new)) if old != new => Some("the host changed"),
            _ => None,
        };
        if let Some(why) = lost.filter(|_| self.requester.in_flight() > 0) {
            self.requester.abort_all(at, Error::Unreachable(why.into()));
        }
        self.host = host;
        if let Some(host) = host {
            self.requester.set_requester_id(me);
            while let Some(tlp) = self.requester.poll_transmit(at) {
                send(host, &tlp);
            }
        }
        self.tag_freed = false;
        self.collect();
    }

    /// Feeds a completion from `peer`; false if it matches no read in flight. The caller pumps.
    pub(crate) fn complete(&mut self, peer: MacAddr, tlp: &Tlp, payload: &[u8], now: Instant) -> bool {
        if self.host != Some(peer) {
            return false;
        }
        let before = self.requester.requests_in_flight();
        if self.requester.handle_completion_payload(self.at(now), tlp, payload).is_err() {
            return false;
        }
        // Copied into the read's buffer.
        add(&self.counters.payload_bytes_copied, payload.len());
        // A freed tag matters to the worker only if a request waits for one (a read that ends
        // says so in `end`): a wake-up per completion of a long read would cost the worker a
        // context switch per 4 KiB.
        if self.requester.requests_in_flight() < before && self.requester.queued_requests() > 0 {
            self.tag_freed = true;
        }
        self.collect();
        true
    }

    /// Whether a tag was freed that a queued request waits for, and no `pump` sent it yet. The
    /// receive thread pumps it at once, so the worker need not wake for it.
    pub(crate) fn tag_freed(&self) -> bool {
        self.tag_freed
    }

    /// Fails the reads whose completions are overdue and ends the quarantines that are over.
    /// The caller pumps.
    pub(crate) fn expire(&mut self, now: Instant) {
        let at = self.at(now);
        if self.requester.poll_timeout().is_some_and(|t| t <= at) {
            self.requester.handle_timeout(at);
            self.changed = true;
            self.collect();
        }
    }

    /// Fails every read with `error` (the host is gone).
    pub(crate) fn fail_all(&mut self, error: DmaError) {
        let at = self.at(Instant::now());
        self.requester.abort_all(at, Error::Unreachable(error.to_string()));
        self.host = None;
        self.collect();
        self.changed = true;
    }

    /// The earliest instant `expire` has work: a read's deadline or a quarantine's end.
    pub(crate) fn next_deadline(&mut self) -> Option<Instant> {
        let at = self.requester.poll_timeout()?;
        Some(self.origin + Duration::from_nanos(at.as_nanos()))
    }

    /// Moves the requester's ended transactions to `finished`.
    fn collect(&mut self) {
        while let Some(event) = self.requester.poll_event() {
            let (id, result) = match event {
                RequesterEvent::Done { id, data } => (id, Ok(data)),
                RequesterEvent::Failed { id, error } => (id, Err(dma_error(error))),
            };
            if let Some(op) = self.ops.remove(&id) {
                self.end(op, result);
            }
        }
    }

    fn end(&mut self, op: OpId, result: Result<Vec<u8>, DmaError>) {
        if result.is_err() {
            bump(&self.counters.dma_read_failures);
        }
        if self.discarded.remove(&op) {
            return;
        }
        // Nobody waits for an unclaimed prefetch: its end wakes nobody.
        let prefetch = self.prefetched.iter().any(|&(_, _, p)| p == op);
        if !prefetch && (result.is_err() || self.awaiting.is_none_or(|a| a == op)) {
            self.changed = true;
        }
        self.finished.push_back((op, result));
    }

    /// A finished read, if any (unclaimed prefetches wait for their claim).
    pub(crate) fn poll(&mut self) -> Option<(OpId, Result<Vec<u8>, DmaError>)> {
        let i =
            self.finished.iter().position(|(op, _)| !self.prefetched.iter().any(|&(_, _, p)| p == *op))?;
        self.finished.remove(i)
    }

    /// Read `op`'s result if it finished; `Some(Err(Timeout))` if no such read is known.
    pub(crate) fn take(&mut self, op: OpId) -> Option<Result<Vec<u8>, DmaError>> {
        match self.finished.iter().position(|(id, _)| *id == op) {
            Some(i) => Some(self.finished.remove(i).expect("found").1),
            None if !self.ops.values().any(|o| *o == op) => Some(Err(DmaError::Timeout)),
            None => None,
        }
    }

    /// Sets the read the worker is about to sleep for (`None`: any read that ends wakes it).
    pub(crate) fn set_awaiting(&mut self, op: Option<OpId>) {
        self.awaiting = op;
    }

    /// Whether a tag a waiting request needs was freed, or a read ended, since the last
    /// `take_changed`.
    pub(crate) fn changed(&self) -> bool {
        self.changed || self.tag_freed
    }

    pub(crate) fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed) | std::mem::take(&mut self.tag_freed)
    }
}

/// What a failed transaction means to the model.
fn dma_error(error: Error) -> DmaError {
    match error {
        Error::CompletionTimeout => DmaError::Timeout,
        Error::CompletionStatus(status) => DmaError::Completion(status),
        Error::Unreachable(_) => DmaError::HostUnreachable,
        // Completions that did not add up: the host's mistake, reported as an abort.
        _ => DmaError::Completion(CplStatus::CompleterAbort),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanbus_pcie::request::completions_for_read;

    const HOST: MacAddr = MacAddr([2, 0, 0, 0, 0, 1]);

    /// A function's reads with `tags` tags.
    fn reads(tags: u16) -> Reads {
        Reads::new(Arc::new(Counters::default()), Duration::from_secs(1), tags)
    }

    fn pump(r: &mut Reads) -> Vec<Tlp> {
        let mut sent = Vec::new();
        r.pump(Some(HOST), Bdf(8), Instant::now(), |_, t| sent.push(t.clone()));
        sent
    }

    /// The host's answer to one read request: 4 KiB completions of a byte pattern.
    fn answer(rd: &Tlp) -> Vec<Tlp> {
        completions_for_read(rd, Bdf(0), 4096, 64, |a, buf| {
            for (i, b) in buf.iter_mut().enumerate() {
                *b = (a as usize + i) as u8;
            }
            Ok(())
        })
        .unwrap()
    }

    #[test]
    fn the_worker_wakes_for_a_whole_read_not_for_each_completion() {
        let mut r = reads(256);
        let op = r.start(0x10_0000, 64 << 10, 4096, Instant::now());
        let sent = pump(&mut r);
        assert_eq!(sent.len(), 16);
        r.take_changed();
        for (i, rd) in sent.iter().enumerate() {
            for c in answer(rd) {
                assert!(r.complete(HOST, &c, &c.data, Instant::now()));
            }
            // A freed tag that no request waits for wakes nobody; the last piece ends the read.
            assert_eq!(r.take_changed(), i == 15, "after piece {i}");
        }
        let data = r.take(op).unwrap().unwrap();
        assert!(data.iter().enumerate().all(|(i, b)| *b == (0x10_0000 + i) as u8));
    }

    #[test]
    fn a_freed_tag_wakes_the_worker_when_a_request_waits_for_it() {
        let mut r = reads(2);
        let op = r.start(0x2000, 4 * 4096, 4096, Instant::now());
        let sent = pump(&mut r);
        assert_eq!(sent.len(), 2, "two tags, two requests out");
        r.take_changed();
        for c in answer(&sent[0]) {
            r.complete(HOST, &c, &c.data, Instant::now());
        }
        assert!(r.take_changed(), "two requests wait for the freed tag");
        assert_eq!(pump(&mut r).len(), 1);
        assert!(r.take(op).is_none());
    }

    #[test]
    fn while_the_worker_awaits_one_read_others_ending_do_not_wake_it() {
        let mut r = reads(256);
        let first = r.start(0x1000, 4096, 4096, Instant::now());
        let second = r.start(0x8000, 4096, 4096, Instant::now());
        let sent = pump(&mut r);
        r.take_changed();
        r.set_awaiting(Some(second));
        for c in answer(&sent[0]) {
            r.complete(HOST, &c, &c.data, Instant::now());
        }
        assert!(!r.take_changed(), "the first read ended; the worker waits for the second");
        for c in answer(&sent[1]) {
            r.complete(HOST, &c, &c.data, Instant::now());
        }
        assert!(r.take_changed());
        r.set_awaiting(None);
        assert!(r.take(first).unwrap().is_ok());
        assert!(r.take(second).unwrap().is_ok());
    }

    #[test]
    fn a_prefetch_is_claimed_once_by_a_read_of_exactly_its_range() {
        let mut r = reads(256);
        r.prefetch(0x4000, 128, 4096, Instant::now());
        r.prefetch(0x4000, 128, 4096, Instant::now());
        let sent = pump(&mut r);
        assert_eq!(sent.len(), 1, "the same range twice is one read");
        r.take_changed();
        for c in answer(&sent[0]) {
            assert!(r.complete(HOST, &c, &c.data, Instant::now()));
        }
        assert!(!r.take_changed(), "nobody waits for a prefetch");
        assert!(r.poll().is_none(), "a prefetch waits for its claim");
        assert_eq!(r.claim(0x4000, 64), None, "another length is another read");
        r.prefetch(0x4000, 128, 4096, Instant::now());
        let sent = pump(&mut r);
        for c in answer(&sent[0]) {
            r.complete(HOST, &c, &c.data, Instant::now());
        }
        let op = r.claim(0x4000, 128).expect("prefetched");
        let data = r.take(op).unwrap().unwrap();
        assert!(data.iter().enumerate().all(|(i, b)| *b == (0x4000 + i) as u8));
        assert_eq!(r.claim(0x4000, 128), None, "used once");
        assert!(r.poll().is_none());
        assert_eq!(r.counters.prefetched_reads.load(std::sync::atomic::Ordering::Relaxed), 2);
        assert_eq!(r.counters.prefetches_used.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    #[test]
    fn a_claimed_prefetch_still_in_flight_wakes_the_worker_when_it_ends() {
        let mut r = reads(256);
        r.prefetch(0x4000, 64, 4096, Instant::now());
        let sent = pump(&mut r);
        let op = r.claim(0x4000, 64).unwrap();
        assert!(r.take(op).is_none(), "in flight");
        r.take_changed();
        r.set_awaiting(Some(op));
        for c in answer(&sent[0]) {
            r.complete(HOST, &c, &c.data, Instant::now());
        }
        assert!(r.take_changed());
        assert!(r.take(op).unwrap().is_ok());
    }

    #[test]
    fn prefetches_overlapping_a_read_or_left_after_a_run_are_thrown_away() {
        let mut r = reads(256);
        // Finished, then overlapped by the worker's own read of part of it.
        r.prefetch(0x4000, 256, 4096, Instant::now());
        let sent = pump(&mut r);
        for c in answer(&sent[0]) {
            r.complete(HOST, &c, &c.data, Instant::now());
        }
        assert_eq!(r.claim(0x4040, 64), None);
        assert_eq!(r.claim(0x4000, 256), None, "dropped by the overlapping read");
        assert!(r.poll().is_none(), "its result is gone");
        // Still in flight when the run ends: its result is dropped when it comes.
        r.prefetch(0x8000, 64, 4096, Instant::now());
        let sent = pump(&mut r);
        r.drop_prefetches();
        r.take_changed();
        for c in answer(&sent[0]) {
            r.complete(HOST, &c, &c.data, Instant::now());
        }
        assert!(!r.take_changed());
        assert!(r.poll().is_none());
        assert_eq!(r.claim(0x8000, 64), None);
        // A newer prefetch over an older one replaces it.
        r.prefetch(0xc000, 128, 4096, Instant::now());
        r.prefetch(0xc040, 128, 4096, Instant::now());
        assert!(r.claim(0xc040, 128).is_some());
        assert_eq!(r.claim(0xc000, 128), None);
    }

    #[test]
    fn a_failed_read_wakes_the_worker_whatever_it_awaits() {
        let mut r = reads(256);
        let first = r.start(0x1000, 4096, 4096, Instant::now());
        let second = r.start(0x8000, 4096, 4096, Instant::now());
        pump(&mut r);
        r.take_changed();
        r.set_awaiting(Some(second));
        r.fail_all(DmaError::HostUnreachable);
        assert!(r.take_changed());
        assert_eq!(r.take(first), Some(Err(DmaError::HostUnreachable)));
    }
}
