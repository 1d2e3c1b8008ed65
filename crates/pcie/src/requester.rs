//! The requester side of PCIe transactions as a sans-IO state machine: memory reads of any
//! length and configuration reads and writes, with tags, splitting, reassembly, a completion
//! timeout and a tag quarantine.
//!
//! Layer: pcie engine. Both bridges drive it: the host bridge for configuration and MMIO reads
//! (one requester per device session), the device bridge for each function's DMA reads of host
//! memory. Implements PCIe Base Specification 2.2.7 (reads split by Max_Read_Request_Size, never
//! crossing 4 KiB), 2.2.6.2 (one tag per outstanding non-posted request), 2.3.2 (completion
//! handling) and 2.8 (completion timeout). Posted writes need no requester state: the bridges
//! encode them straight from the caller's bytes (`request::write_requests` describes them).
//!
//! Call order (quinn style): start transactions with [`Requester::read`],
//! [`Requester::config_read`] and [`Requester::config_write`]; send what
//! [`Requester::poll_transmit`] returns (requests wait there for a free tag) after every call
//! that starts or handles something, since each may free a tag; feed every completion from the
//! completer to [`Requester::handle_completion`]; when `now` reaches
//! [`Requester::poll_timeout`], call [`Requester::handle_timeout`]; drain
//! [`Requester::poll_event`]. `now` never goes backwards.
//!
//! Invariants:
//! - every transaction ends in exactly one [`RequesterEvent`], and every transaction ends: its
//!   requests in flight time out one completion timeout after they were sent; a request waiting
//!   for a tag times out when neither it nor any completion of the requester moved for one
//!   completion timeout (it is not stalled while the requests ahead of it progress);
//! - tags are reused oldest-freed first; a tag whose request timed out or was abandoned stays
//!   quarantined until one more completion timeout has passed or [`Requester::handle_reset`]
//!   says the channel that carried it was reset, so a late completion can never complete a newer
//!   request;
//! - completions for no outstanding tag, or inconsistent with their request, are errors and
//!   counted, never applied.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use lanbus_wire::time::Instant;

use crate::reassembly::{Progress, ReadReassembly};
use crate::request::{split, Chunk};
use crate::tags::TagAllocator;
use crate::tlp::{Bdf, CplStatus, Header, Tag, Tlp, TlpKind};
use crate::{Error, Result};

/// Names one transaction of a [`Requester`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TransactionId(pub u64);

/// A map keyed by [`TransactionId`] with a cheap hash: the ids are a local counter, never chosen
/// by a peer, so the default hasher's protection against chosen keys buys nothing here, while the
/// map sits on every request's path.
pub type TransactionMap<V> = HashMap<TransactionId, V, BuildIdHasher>;

pub use lanbus_wire::hash::{BuildIdHasher, IdHasher};

/// How a transaction ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequesterEvent {
    /// All bytes read (memory reads: the requested bytes; configuration reads: the DW, disabled
    /// bytes as the completer sent them; configuration writes: empty).
    Done {
        /// The transaction.
        id: TransactionId,
        /// The bytes.
        data: Vec<u8>,
    },
    /// The transaction failed: a completion status, an inconsistent read, a timeout, or an abort.
    Failed {
        /// The transaction.
        id: TransactionId,
        /// Why.
        error: Error,
    },
}

/// Counters of what the requester saw go wrong.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequesterCounters {
    /// Completions for no outstanding tag, or of the wrong shape.
    pub unexpected_completions: u64,
    /// Requests that timed out (in flight, or waiting for a tag).
    pub timeouts: u64,
}

#[derive(Debug)]
struct Transaction {
    /// The bytes read so far: the parts ended in address order, appended, or all `len` bytes
    /// once one ended out of order; the reassembled bytes as they are if the first part to end
    /// is the whole transaction.
    data: Vec<u8>,
    len: usize,
    /// Parts not yet ended.
    parts_left: usize,
    failed: bool,
}

impl Transaction {
    /// Puts a part's bytes at `offset`.
    fn place(&mut self, offset: usize, bytes: Vec<u8>) {
        if self.data.is_empty() && offset == 0 && bytes.len() == self.len {
            self.data = bytes;
            return;
        }
        // Parts usually end in address order: each is appended, nothing zeroed first.
        if offset == self.data.len() && offset + bytes.len() <= self.len {
            self.data.reserve_exact(self.len - self.data.len());
            self.data.extend_from_slice(&bytes);
            return;
        }
        if self.data.len() < self.len {
            self.data.resize(self.len, 0);
        }
        if let Some(dst) = self.data.get_mut(offset..offset + bytes.len()) {
            dst.copy_from_slice(&bytes);
        }
    }
}

#[derive(Debug)]
enum Part {
    Memory {
        offset: usize,
        reassembly: ReadReassembly,
    },
    /// A configuration request: one completion (CplD for reads, Cpl for writes).
    Config {
        write: bool,
    },
}

/// A request in flight, under its tag.
#[derive(Debug)]
struct InFlight {
    id: TransactionId,
    part: Part,
}

#[derive(Debug)]
enum Request {
    Memory { chunk: Chunk, base: u64 },
    Config(Tlp),
}

/// A request waiting for a tag.
#[derive(Debug)]
struct Queued {
    id: TransactionId,
    request: Request,
    since: Instant,
}

/// Tracks one requester's non-posted transactions toward one completer session. See the module
/// docs for the call order.
#[derive(Debug)]
pub struct Requester {
    requester_id: Bdf,
    mrrs: usize,
    timeout: Duration,
    tags: TagAllocator,
    next_id: u64,
    transactions: TransactionMap<Transaction>,
    /// Indexed by tag.
    in_flight: Vec<Option<InFlight>>,
    queued: VecDeque<Queued>,
    /// When a completion was last accepted.
    progress: Instant,
    events: VecDeque<RequesterEvent>,
    counters: RequesterCounters,
}

impl Requester {
    /// A requester with ID `requester_id`, `tag_count` tags (1 to 1024), a completion `timeout`,
    /// and a max read request size `mrrs` in bytes (a power of two, 128..=4096).
    pub fn new(requester_id: Bdf, tag_count: u16, timeout: Duration, mrrs: usize) -> Result<Requester> {
        split(0, 1, mrrs)?;
        let tags = TagAllocator::new(tag_count, timeout);
        let count = usize::from(tag_count.clamp(1, Tag::COUNT));
        Ok(Requester {
            requester_id,
            mrrs,
            timeout,
            tags,
            next_id: 0,
            transactions: TransactionMap::default(),
            in_flight: (0..count).map(|_| None).collect(),
            queued: VecDeque::new(),
            progress: Instant::ZERO,
            events: VecDeque::new(),
            counters: RequesterCounters::default(),
        })
    }

    /// Changes the max read request size (for example once enumeration has programmed it);
    /// affects reads started afterwards.
    pub fn set_max_read_request(&mut self, mrrs: usize) -> Result<()> {
        split(0, 1, mrrs)?;
        self.mrrs = mrrs;
        Ok(())
    }

    /// Changes the ID requests carry (a device learns its bus number from its host's
    /// configuration writes); affects requests sent afterwards.
    pub fn set_requester_id(&mut self, requester_id: Bdf) {
        self.requester_id = requester_id;
    }

    /// What went wrong so far.
    pub fn counters(&self) -> RequesterCounters {
        self.counters
    }

    /// Transactions not yet ended.
    pub fn in_flight(&self) -> usize {
        self.transactions.len()
    }

    /// Requests sent whose completions are still due.
    pub fn requests_in_flight(&self) -> usize {
        self.tags.outstanding()
    }

    /// Requests waiting for a tag (sent by the next [`Requester::poll_transmit`]s as tags free).
    pub fn queued_requests(&self) -> usize {
        self.queued.len()
    }

    /// Tags quarantined after a timeout or an abort.
    pub fn quarantined_tags(&self) -> usize {
        self.tags.quarantined()
    }

    fn start(
        &mut self,
        len: usize,
        requests: impl IntoIterator<Item = Request>,
        now: Instant,
    ) -> TransactionId {
        let id = TransactionId(self.next_id);
        self.next_id += 1;
        let before = self.queued.len();
        self.queued.extend(requests.into_iter().map(|request| Queued { id, request, since: now }));
        let parts = self.queued.len() - before;
        self.transactions.insert(id, Transaction { data: Vec::new(), len, parts_left: parts, failed: false });
        id
    }

    /// Starts a memory read of `len` bytes at `address` at `now` (0 is a zero-length read).
    pub fn read(&mut self, now: Instant, address: u64, len: usize) -> Result<TransactionId> {
        let chunks = split(address, len, self.mrrs)?;
        Ok(self.start(len, chunks.into_iter().map(|chunk| Request::Memory { chunk, base: address }), now))
    }

    /// Starts a type 0 configuration read of the DW at `register` of `target` at `now`.
    pub fn config_read(
        &mut self,
        now: Instant,
        target: Bdf,
        register: u16,
        first_be: u8,
    ) -> Result<TransactionId> {
        let tlp = Tlp::cfg_read(false, self.requester_id, Tag::default(), target, register, first_be);
        tlp.check()?;
        Ok(self.start(0, [Request::Config(tlp)], now))
    }

    /// Starts a type 0 configuration write of one DW to `register` of `target` at `now`.
    pub fn config_write(
        &mut self,
        now: Instant,
        target: Bdf,
        register: u16,
        first_be: u8,
        value: [u8; 4],
    ) -> Result<TransactionId> {
        let tlp = Tlp::cfg_write(false, self.requester_id, Tag::default(), target, register, first_be, value);
        tlp.check()?;
        Ok(self.start(0, [Request::Config(tlp)], now))
    }

    /// The next request to send at `now`, as tags allow, oldest first.
    #[must_use]
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Tlp> {
        loop {
            let id = self.queued.front()?.id;
            // Requests of a failed transaction are not sent.
            if self.transactions.get(&id).is_none_or(|t| t.failed) {
                self.queued.pop_front();
                self.finish_part(id);
                continue;
            }
            let tag = self.tags.allocate(now)?;
            let queued = self.queued.pop_front()?;
            let (part, tlp) = match queued.request {
                Request::Memory { chunk, base } => {
                    let s = chunk.shape();
                    let reassembly = ReadReassembly::new(self.requester_id, tag, chunk.address, chunk.len)
                        .expect("chunks are valid reads");
                    let offset = (chunk.address - base) as usize;
                    let tlp =
                        Tlp::mem_read(self.requester_id, tag, s.address, s.length_dw, s.first_be, s.last_be);
                    (Part::Memory { offset, reassembly }, tlp)
                }
                Request::Config(mut tlp) => {
                    tlp.tag = tag;
                    (Part::Config { write: tlp.kind == TlpKind::CfgWr0 }, tlp)
                }
            };
            self.in_flight[usize::from(tag.get())] = Some(InFlight { id, part });
            return Some(tlp);
        }
    }

    /// One part of transaction `id` is over (successfully or not); ends it when all are.
    fn finish_part(&mut self, id: TransactionId) {
        let Some(t) = self.transactions.get_mut(&id) else { return };
        t.parts_left = t.parts_left.saturating_sub(1);
        if t.parts_left == 0 {
            let mut t = self.transactions.remove(&id).expect("present");
            if !t.failed {
                // Zero-length reads and configuration writes end with no bytes placed.
                let len = t.len.max(t.data.len());
                t.data.resize(len, 0);
                self.events.push_back(RequesterEvent::Done { id, data: t.data });
            }
        }
    }

    /// Fails transaction `id` (reported once; its other parts still finish quietly).
    fn fail(&mut self, id: TransactionId, error: Error) {
        if let Some(t) = self.transactions.get_mut(&id) {
            if !t.failed {
                t.failed = true;
                self.events.push_back(RequesterEvent::Failed { id, error });
            }
        }
    }

    /// Takes a completion from the completer at `now`. An error means the completion was not
    /// applied and was counted: unexpected (no such tag in flight, another requester's, not a
    /// completion) or inconsistent with its request (the request stays in flight: the right
    /// completions may still come, or the timeout ends it). A completion status other than
    /// success ends the transaction with [`RequesterEvent::Failed`]; that is not an error here.
    pub fn handle_completion(&mut self, now: Instant, cpl: &Tlp) -> Result<()> {
        self.handle_completion_payload(now, cpl, &cpl.data)
    }

    /// [`handle_completion`](Self::handle_completion) for a completion decoded in place
    /// ([`Tlp::decode_borrowed`]): its `data` left empty, its `payload` still in the frame.
    pub fn handle_completion_payload(&mut self, now: Instant, cpl: &Tlp, payload: &[u8]) -> Result<()> {
        let tag = usize::from(cpl.tag.get());
        let ours = matches!(&cpl.header, Header::Completion(h) if h.requester_id == self.requester_id);
        let Some(mut flight) = self.in_flight.get_mut(tag).and_then(|f| f.take_if(|_| ours)) else {
            self.counters.unexpected_completions += 1;
            return Err(Error::UnexpectedCompletion("no request in flight with this tag"));
        };
        let id = flight.id;
        let step: Result<bool> = match &mut flight.part {
            Part::Memory { reassembly, .. } => {
                reassembly.handle_completion_payload(cpl, payload).map(|p| p == Progress::Complete)
            }
            Part::Config { write } => {
                let Header::Completion(h) = &cpl.header else { unreachable!("matched above") };
                match (h.status, *write, cpl.kind, payload.len()) {
                    (CplStatus::Success, true, TlpKind::Cpl, _) => Ok(true),
                    (CplStatus::Success, false, TlpKind::CplD, 4) => {
                        if let Some(t) = self.transactions.get_mut(&id) {
                            t.data.clear();
                            t.data.extend_from_slice(payload);
                        }
                        Ok(true)
                    }
                    (CplStatus::Success, _, _, _) => {
                        Err(Error::InconsistentCompletion("configuration completion of the wrong shape"))
                    }
                    (status, _, TlpKind::Cpl, _) => Err(Error::CompletionStatus(status)),
                    _ => Err(Error::InconsistentCompletion("unsuccessful completion with data")),
                }
            }
        };
        match step {
            Ok(false) => {
                self.progress = now;
                self.in_flight[tag] = Some(flight);
                Ok(())
            }
            Ok(true) => {
                self.progress = now;
                if let Part::Memory { offset, reassembly } = flight.part {
                    match reassembly.into_data() {
                        Ok(d) => {
                            if let Some(t) = self.transactions.get_mut(&id) {
                                t.place(offset, d);
                            }
                        }
                        Err(e) => self.fail(id, e),
                    }
                }
                self.tags.complete(cpl.tag);
                self.finish_part(id);
                Ok(())
            }
            Err(Error::CompletionStatus(status)) => {
                self.progress = now;
                self.tags.complete(cpl.tag);
                self.fail(id, Error::CompletionStatus(status));
                self.finish_part(id);
                Ok(())
            }
            Err(e) => {
                self.in_flight[tag] = Some(flight);
                self.counters.unexpected_completions += 1;
                Err(e)
            }
        }
    }

    /// When a request in flight or waiting for a tag times out, or a quarantine ends.
    #[must_use]
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        let waiting = self.waiting_deadline();
        match (self.tags.poll_timeout(), waiting) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// When the oldest request waiting for a tag fails unless the requester progresses: one
    /// timeout after it was queued or after the last completion, whichever is later. None while
    /// a tag is free (the request waits for `poll_transmit`, not for a tag).
    fn waiting_deadline(&self) -> Option<Instant> {
        if self.tags.has_free() {
            return None;
        }
        self.queued.front().map(|q| q.since.max(self.progress) + self.timeout)
    }

    /// Fails the transactions whose requests timed out by `now`: in flight, or waiting for a tag
    /// with no progress.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(tag) = self.tags.poll_expired(now) {
            if let Some(f) = self.in_flight[usize::from(tag.get())].take() {
                self.counters.timeouts += 1;
                self.fail(f.id, Error::CompletionTimeout);
                self.finish_part(f.id);
            }
        }
        while let Some(deadline) = self.waiting_deadline() {
            if deadline > now {
                break;
            }
            let id = self.queued.front().expect("a deadline means a request").id;
            self.queued.pop_front();
            if self.transactions.get(&id).is_some_and(|t| !t.failed) {
                self.counters.timeouts += 1;
            }
            self.fail(id, Error::CompletionTimeout);
            self.finish_part(id);
        }
    }

    /// Fails every transaction at `now` with `error` (the completer is gone). Their tags in
    /// flight are quarantined: completions for them may still be on the way.
    pub fn abort_all(&mut self, now: Instant, error: Error) {
        let ids: Vec<TransactionId> = self.transactions.keys().copied().collect();
        for id in ids {
            self.fail(id, error.clone());
        }
        for (tag, slot) in self.in_flight.iter_mut().enumerate() {
            if slot.take().is_some() {
                if let Some(t) = Tag::new(tag as u16) {
                    self.tags.abandon(t, now);
                }
            }
        }
        self.transactions.clear();
        self.queued.clear();
    }

    /// The channel that carried this requester's requests was reset: nothing sent on it can
    /// arrive any more, so quarantined tags are free at once.
    pub fn handle_reset(&mut self) {
        self.tags.release_all();
    }

    /// The next ended transaction.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<RequesterEvent> {
        self.events.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Function;
    use crate::dma_engine::DmaEngine;
    use crate::request::completions_for_read;
    use rand::{Rng, SeedableRng};

    const ME: Bdf = Bdf(0x0000);
    const DEV: Bdf = Bdf(0x0300);
    const MS: Duration = Duration::from_millis(1);
    const T0: Instant = Instant::ZERO;

    fn memory() -> Vec<u8> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        (0..65536).map(|_| rng.random()).collect()
    }

    fn ms(n: u64) -> Instant {
        T0 + MS * n as u32
    }

    fn requests(r: &mut Requester, now: Instant) -> Vec<Tlp> {
        std::iter::from_fn(|| r.poll_transmit(now)).collect()
    }

    fn events(r: &mut Requester) -> Vec<RequesterEvent> {
        std::iter::from_fn(|| r.poll_event()).collect()
    }

    /// The completions a completer with MPS 256 and RCB 64 sends for read `t` of `mem`.
    fn completions(t: &Tlp, mem: &[u8]) -> Vec<Tlp> {
        completions_for_read(t, DEV, 256, 64, |a, buf| {
            buf.copy_from_slice(&mem[a as usize..a as usize + buf.len()]);
            Ok(())
        })
        .unwrap()
    }

    /// Answers every read the requester sends from `mem`, tags interleaved at random (each
    /// tag's completions in order, as PCIe requires).
    fn serve(r: &mut Requester, mem: &[u8], now: Instant, rng: &mut impl Rng) {
        let mut per_tag: Vec<VecDeque<Tlp>> =
            requests(r, now).iter().map(|t| VecDeque::from(completions(t, mem))).collect();
        while !per_tag.is_empty() {
            let i = rng.random_range(0..per_tag.len());
            let c = per_tag[i].pop_front().unwrap();
            r.handle_completion(now, &Tlp::decode(&c.encode().unwrap()).unwrap()).unwrap();
            if per_tag[i].is_empty() {
                per_tag.swap_remove(i);
            }
        }
    }

    #[test]
    fn reads_of_any_length_with_few_tags() {
        let mem = memory();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let mut r = Requester::new(ME, 8, 10 * MS, 512).unwrap();
        let reads = [(0x1003u64, 10_000usize), (0, 0), (0x7fff, 1), (0x100, 4096), (0xfff0, 16)];
        let ids: Vec<_> = reads.iter().map(|&(a, l)| r.read(T0, a, l).unwrap()).collect();
        let mut done = HashMap::new();
        let mut rounds = 0;
        while r.in_flight() > 0 {
            serve(&mut r, &mem, T0, &mut rng);
            for e in events(&mut r) {
                let RequesterEvent::Done { id, data } = e else { panic!("{e:?}") };
                assert!(done.insert(id, data).is_none(), "one event per transaction");
            }
            rounds += 1;
            assert!(rounds < 100);
        }
        assert!(rounds > 3, "8 tags cannot carry it all at once");
        for (id, (a, l)) in ids.iter().zip(reads) {
            assert_eq!(done[id], &mem[a as usize..a as usize + l]);
        }
        assert_eq!(r.counters(), RequesterCounters::default());
    }

    #[test]
    fn enumerates_a_function_through_config_tlps() {
        let mut f = Function::new(DmaEngine::new()).unwrap();
        let mut r = Requester::new(ME, 32, 10 * MS, 512).unwrap();
        let mut exchange = |r: &mut Requester| {
            while let Some(t) = r.poll_transmit(T0) {
                for c in f.handle_request(&Tlp::decode(&t.encode().unwrap()).unwrap()).unwrap() {
                    r.handle_completion(T0, &c).unwrap();
                }
            }
            events(r)
        };
        let ids = r.config_read(T0, DEV, 0, 0xf).unwrap();
        let size = [
            r.config_write(T0, DEV, 0x10, 0xf, [0xff; 4]).unwrap(),
            r.config_read(T0, DEV, 0x10, 0xf).unwrap(),
        ];
        let ev = exchange(&mut r);
        assert_eq!(ev[0], RequesterEvent::Done { id: ids, data: vec![0x42, 0x4c, 0x01, 0x00] });
        assert_eq!(ev[1], RequesterEvent::Done { id: size[0], data: vec![] });
        assert_eq!(ev[2], RequesterEvent::Done { id: size[1], data: 0xffff_f000u32.to_le_bytes().to_vec() });
        // Type 1 to an endpoint is refused: the transaction fails with UR.
        let mut t1 = r.config_read(T0, DEV, 0, 0xf).unwrap();
        if let Some(Queued { request: Request::Config(tlp), .. }) = r.queued.back_mut() {
            tlp.kind = TlpKind::CfgRd1;
        }
        let ev = exchange(&mut r);
        assert_eq!(
            ev,
            vec![RequesterEvent::Failed {
                id: t1,
                error: Error::CompletionStatus(CplStatus::UnsupportedRequest)
            }]
        );
        t1 = r.read(T0, 0xdead_0000, 4).unwrap();
        while let Some(t) = r.poll_transmit(T0) {
            for c in f.handle_request(&t).unwrap() {
                r.handle_completion(T0, &c).unwrap();
            }
        }
        assert_eq!(
            r.poll_event(),
            Some(RequesterEvent::Failed {
                id: t1,
                error: Error::CompletionStatus(CplStatus::UnsupportedRequest)
            })
        );
    }

    #[test]
    fn timeouts_unexpected_and_inconsistent_completions() {
        let mem = memory();
        let mut r = Requester::new(ME, 4, 10 * MS, 512).unwrap();
        let id = r.read(T0, 0x400, 1024).unwrap();
        let reqs = requests(&mut r, T0);
        assert_eq!(reqs.len(), 2);
        assert_eq!(r.poll_timeout(), Some(ms(10)));
        // The first half answered, with a lying completion and a stranger's thrown in first.
        let c0 = completions(&reqs[0], &mem);
        let mut liar = c0[0].clone();
        liar.data.truncate(8);
        liar.length_dw = 2;
        if let Header::Completion(h) = &mut liar.header {
            h.lower_address = 8;
        }
        assert!(matches!(r.handle_completion(T0, &liar), Err(Error::InconsistentCompletion(_))));
        let mut stranger = c0[0].clone();
        stranger.tag = Tag::new(3).unwrap();
        assert!(matches!(r.handle_completion(T0, &stranger), Err(Error::UnexpectedCompletion(_))));
        for c in &c0 {
            r.handle_completion(T0, c).unwrap();
        }
        assert_eq!(r.poll_event(), None);
        // The second half never comes.
        r.handle_timeout(ms(9));
        assert_eq!(r.poll_event(), None);
        r.handle_timeout(ms(10));
        assert_eq!(r.poll_event(), Some(RequesterEvent::Failed { id, error: Error::CompletionTimeout }));
        assert_eq!(r.in_flight(), 0);
        // Too late now.
        let late = completions(&reqs[1], &mem);
        assert!(r.handle_completion(ms(10), &late[0]).is_err());
        let c = r.counters();
        assert_eq!((c.unexpected_completions, c.timeouts), (3, 1));

        // A completer that goes away: its transaction fails, the tag in flight is quarantined.
        let id = r.read(ms(10), 0, 100).unwrap();
        assert_eq!(requests(&mut r, ms(10)).len(), 1);
        r.abort_all(ms(10), Error::Unreachable("heartbeats stopped".into()));
        let ev = r.poll_event();
        assert!(
            matches!(ev, Some(RequesterEvent::Failed { id: i, error: Error::Unreachable(_) }) if i == id)
        );
        assert_eq!((r.in_flight(), r.quarantined_tags()), (0, 2));
        // Quarantines end one timeout after the timeout: at 20 for the tag that timed out at 10,
        // at 30 for the abandoned one (its request's own deadline was 20).
        assert_eq!(r.poll_timeout(), Some(ms(20)));
        r.handle_timeout(ms(20));
        assert_eq!((r.quarantined_tags(), r.poll_timeout()), (1, Some(ms(30))));
        r.handle_timeout(ms(30));
        assert_eq!((r.quarantined_tags(), r.poll_timeout()), (0, None));
    }

    #[test]
    fn a_late_completion_for_a_timed_out_tag_never_completes_a_newer_request() {
        let mem = memory();
        // One tag: any newer request must reuse the timed-out one's.
        let mut r = Requester::new(ME, 1, 10 * MS, 512).unwrap();
        let old = r.read(T0, 0x100, 64).unwrap();
        let old_req = requests(&mut r, T0);
        r.handle_timeout(ms(10));
        assert_eq!(events(&mut r), vec![RequesterEvent::Failed { id: old, error: Error::CompletionTimeout }]);
        // A newer read waits: the only tag is quarantined.
        let new = r.read(ms(10), 0x2000, 64).unwrap();
        assert!(requests(&mut r, ms(15)).is_empty());
        let late = completions(&old_req[0], &mem);
        assert!(matches!(r.handle_completion(ms(15), &late[0]), Err(Error::UnexpectedCompletion(_))));
        // The quarantine ends at 20 (by then the fabric has delivered or lost the old
        // completions): the newer read gets the tag.
        r.handle_timeout(ms(20));
        let new_req = requests(&mut r, ms(20));
        assert_eq!(new_req.len(), 1);
        assert_eq!(new_req[0].tag, old_req[0].tag);
        for c in completions(&new_req[0], &mem) {
            r.handle_completion(ms(22), &c).unwrap();
        }
        assert_eq!(
            events(&mut r),
            vec![RequesterEvent::Done { id: new, data: mem[0x2000..0x2040].to_vec() }]
        );

        // After a channel reset the tag is free at once: nothing of the old channel can arrive.
        let a = r.read(ms(30), 0x100, 64).unwrap();
        assert_eq!(requests(&mut r, ms(30)).len(), 1);
        r.handle_timeout(ms(40));
        assert_eq!(events(&mut r), vec![RequesterEvent::Failed { id: a, error: Error::CompletionTimeout }]);
        r.read(ms(40), 0x200, 64).unwrap();
        assert!(requests(&mut r, ms(40)).is_empty());
        r.handle_reset();
        assert_eq!(requests(&mut r, ms(40)).len(), 1);
    }

    #[test]
    fn a_read_waiting_for_tags_times_out_after_a_stall_instead_of_hanging() {
        let mut r = Requester::new(ME, 256, 100 * MS, 512).unwrap();
        // 1 MiB at MRRS 512: 2048 pieces, every tag in flight; the second read waits for tags.
        let a = r.read(T0, 0x10_0000, 1 << 20).unwrap();
        assert_eq!(requests(&mut r, T0).len(), 256);
        let b = r.read(T0, 0x20_0000, 4096).unwrap();
        assert!(requests(&mut r, T0).is_empty(), "no tag left");
        // The completer stalls for the completion timeout: both reads end, neither hangs.
        assert_eq!(r.poll_timeout(), Some(ms(100)));
        r.handle_timeout(ms(100));
        let failed = |id| RequesterEvent::Failed { id, error: Error::CompletionTimeout };
        assert_eq!(events(&mut r), vec![failed(a), failed(b)]);
        // The tags sit out their quarantine, then serve a new read.
        let c = r.read(ms(100), 0x30_0000, 256 * 512).unwrap();
        assert!(requests(&mut r, ms(150)).is_empty());
        assert_eq!(r.poll_timeout(), Some(ms(200)));
        r.handle_timeout(ms(200));
        let reads = requests(&mut r, ms(200));
        assert_eq!(reads.len(), 256);
        let mem: Vec<u8> = (0..0x40_0000u32).map(|i| i as u8).collect();
        for t in &reads {
            for cpl in completions(t, &mem) {
                r.handle_completion(ms(201), &cpl).unwrap();
            }
        }
        assert_eq!(
            events(&mut r),
            vec![RequesterEvent::Done { id: c, data: mem[0x30_0000..0x32_0000].to_vec() }]
        );
    }

    #[test]
    fn a_read_waiting_for_tags_lives_while_the_reads_ahead_progress() {
        let mem: Vec<u8> = (0..0x40_0000u32).map(|i| i as u8).collect();
        let mut r = Requester::new(ME, 256, 100 * MS, 512).unwrap();
        let _a = r.read(T0, 0x10_0000, 1 << 20).unwrap();
        let first = requests(&mut r, T0);
        let b = r.read(T0, 0x20_0000, 4096).unwrap();
        // The first read progresses (one piece answered) just before the second read has waited
        // a whole timeout: the second one is not failed for waiting.
        for c in completions(&first[0], &mem) {
            r.handle_completion(ms(80), &c).unwrap();
        }
        assert_eq!(requests(&mut r, ms(80)).len(), 1, "the freed tag went to the first read's next piece");
        r.handle_timeout(ms(99));
        assert!(events(&mut r).is_empty(), "nothing failed");
        // It keeps a deadline: a stall from the last progress fails it too.
        r.handle_timeout(ms(180));
        let done = events(&mut r);
        assert!(
            done.contains(&RequesterEvent::Failed { id: b, error: Error::CompletionTimeout }),
            "{done:?}"
        );
        assert_eq!(r.in_flight(), 0);
    }

    proptest::proptest! {
        // Random reads, random interleaving: every transaction ends once with the right bytes.
        #[test]
        fn matches_memory(seed in proptest::num::u64::ANY, n in 1usize..6) {
            let mem = memory();
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let mut r = Requester::new(ME, 16, 10 * MS, 128 << rng.random_range(0..6)).unwrap();
            let mut want = HashMap::new();
            for _ in 0..n {
                let a = rng.random_range(0..60000u64);
                let l = rng.random_range(0..5000usize);
                want.insert(r.read(T0, a, l).unwrap(), mem[a as usize..a as usize + l].to_vec());
            }
            let mut rounds = 0;
            while r.in_flight() > 0 && rounds < 1000 {
                serve(&mut r, &mem, T0, &mut rng);
                rounds += 1;
            }
            let events = events(&mut r);
            proptest::prop_assert_eq!(events.len(), n);
            for e in events {
                let RequesterEvent::Done { id, data } = e else { panic!("{e:?}") };
                proptest::prop_assert_eq!(&data, &want[&id]);
            }
        }

        // Completions lost, duplicated or late at random, time moving on: every transaction
        // ends exactly once, and a transaction that reports its bytes reports the right ones.
        #[test]
        fn ends_every_transaction_once_under_loss_and_late_completions(seed in proptest::num::u64::ANY) {
            let mem = memory();
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let mut r = Requester::new(ME, 4, 10 * MS, 256).unwrap();
            let mut want = HashMap::new();
            let mut ended = HashMap::new();
            // A completion arrives at the latest one quarantine after its request's timeout, as
            // on a fabric that delivers within a bounded time or not at all.
            let mut late: Vec<(Instant, Tlp)> = Vec::new();
            let mut now = T0;
            for _ in 0..300 {
                now += Duration::from_micros(rng.random_range(0..4000));
                if rng.random_ratio(1, 3) {
                    let a = rng.random_range(0..60000u64);
                    let l = rng.random_range(0..2000usize);
                    want.insert(r.read(now, a, l).unwrap(), mem[a as usize..a as usize + l].to_vec());
                }
                for t in requests(&mut r, now) {
                    for c in completions(&t, &mem) {
                        match rng.random_range(0..10) {
                            0 => {}
                            1 => late.push((now + 20 * MS, c)),
                            _ => { let _ = r.handle_completion(now, &c); }
                        }
                    }
                }
                late.retain(|(by, _)| *by > now);
                if !late.is_empty() && rng.random_ratio(1, 4) {
                    let (_, c) = late.swap_remove(rng.random_range(0..late.len()));
                    let _ = r.handle_completion(now, &c);
                }
                if r.poll_timeout().is_some_and(|t| t <= now) {
                    r.handle_timeout(now);
                }
                while let Some(e) = r.poll_event() {
                    let (id, ok) = match e {
                        RequesterEvent::Done { id, data } => {
                            proptest::prop_assert_eq!(&data, &want[&id]);
                            (id, true)
                        }
                        RequesterEvent::Failed { id, .. } => (id, false),
                    };
                    proptest::prop_assert!(ended.insert(id, ok).is_none(), "ended twice");
                }
            }
            // Time runs on with no new work: everything ends.
            for _ in 0..10_000 {
                let _ = requests(&mut r, now);
                let Some(t) = r.poll_timeout() else { break };
                now = now.max(t);
                r.handle_timeout(now);
            }
            while let Some(e) = r.poll_event() {
                let id = match e { RequesterEvent::Done { id, .. } | RequesterEvent::Failed { id, .. } => id };
                proptest::prop_assert!(ended.insert(id, true).is_none(), "ended twice");
            }
            proptest::prop_assert_eq!(ended.len(), want.len());
            proptest::prop_assert_eq!(r.in_flight(), 0);
        }
    }
}
