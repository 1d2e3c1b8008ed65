//! The DMA reads of one device function: the PCIe crate's [`Requester`] driven with the device
//! bridge's clock, toward the function's host.
//!
//! Layer: bridges, device side. Sans-IO in all but the clock: the caller passes `now` and sends
//! what [`Reads::pump`] hands it; the inline path uses it under the function's mutex, a blocking
//! function's worker under its function state's lock. Splitting, tags (with their quarantine),
//! reassembly and the completion timeout are the requester's; this adapter maps its transactions
//! to the model's [`OpId`]s and its errors to [`DmaError`]s, and counts.
//!
//! Invariants: every read started ends once, in [`Reads::poll`] or [`Reads::take`]; completions
//! are accepted only from the host the reads went to; after anything that may free a tag
//! (`complete`, `expire`) the caller calls `pump`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanbus_pcie::device::DmaError;
use lanbus_pcie::requester::{Requester, RequesterEvent, TransactionMap};
use lanbus_pcie::{Bdf, CplStatus, Error, Tlp};
use lanbus_wire::MacAddr;

use crate::counters::{bump, Counters};
use crate::hosted::OpId;

/// The largest read request a function may be programmed with (PCIe's maximum).
const MRRS_MAX: usize = 4096;

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
    /// A tag was freed or a read ended since `take_changed` (the worker wakes on it).
    changed: bool,
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
        self.collect();
    }

    /// Feeds a completion from `peer`; false if it matches no read in flight. The caller pumps.
    pub(crate) fn complete(&mut self, peer: MacAddr, tlp: &Tlp, now: Instant) -> bool {
        if self.host != Some(peer) {
            return false;
        }
        let before = self.requester.requests_in_flight();
        if self.requester.handle_completion(self.at(now), tlp).is_err() {
            return false;
        }
        if self.requester.requests_in_flight() < before {
            self.changed = true;
        }
        self.collect();
        true
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
        self.finished.push_back((op, result));
        self.changed = true;
    }

    /// A finished read, if any.
    pub(crate) fn poll(&mut self) -> Option<(OpId, Result<Vec<u8>, DmaError>)> {
        self.finished.pop_front()
    }

    /// Read `op`'s result if it finished; `Some(Err(Timeout))` if no such read is known.
    pub(crate) fn take(&mut self, op: OpId) -> Option<Result<Vec<u8>, DmaError>> {
        match self.finished.iter().position(|(id, _)| *id == op) {
            Some(i) => Some(self.finished.remove(i).expect("found").1),
            None if !self.ops.values().any(|o| *o == op) => Some(Err(DmaError::Timeout)),
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
