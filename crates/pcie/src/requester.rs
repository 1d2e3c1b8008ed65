//! The requester side of PCIe transactions as a sans-IO state machine: reads of any length,
//! configuration reads and writes, and posted writes, with tags, reassembly and timeouts.
//!
//! Layer: pcie engine; both bridges use it (the host bridge for configuration and MMIO, a
//! device's DMA reads toward the host). Implements PCIe Base Specification 2.2.7 (reads split by
//! Max_Read_Request_Size, never crossing 4 KiB; writes by Max_Payload_Size), 2.2.6.2 (one tag per
//! outstanding non-posted request), 2.3.2 (completion handling) and 2.8 (completion timeout).
//!
//! Call order (quinn style): start transactions with [`Requester::read`], [`Requester::write`],
//! [`Requester::config_read`], [`Requester::config_write`]; send what [`Requester::poll_transmit`]
//! returns (requests wait there for a free tag); feed every completion for this requester to
//! [`Requester::handle_completion`]; when `now` reaches [`Requester::poll_timeout`], call
//! [`Requester::handle_timeout`]; drain [`Requester::poll_event`]. `now` never goes backwards.
//!
//! Invariants: every transaction ends in exactly one [`RequesterEvent`]; a tag stays allocated
//! until its last completion arrives or it times out, even after its transaction failed, so a
//! late completion can never be taken for a newer request's; unexpected completions are errors
//! and counted, never applied.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use lanbus_wire::time::Instant;

use crate::reassembly::{Progress, ReadReassembly};
use crate::request::{split, write_requests, Chunk};
use crate::tags::TagAllocator;
use crate::tlp::{Bdf, CplStatus, Header, Tlp, TlpKind};
use crate::{Error, Result};

/// Names one transaction of a [`Requester`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TransactionId(pub u64);

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
    /// The transaction failed: a completion status, an inconsistent completion, or a timeout.
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
    /// Tags that timed out.
    pub timeouts: u64,
}

#[derive(Debug)]
struct Transaction {
    data: Vec<u8>,
    /// Parts not yet completed.
    parts_left: usize,
    failed: bool,
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

#[derive(Debug)]
struct Pending {
    id: TransactionId,
    part: Part,
}

/// A request waiting for a tag.
#[derive(Debug)]
enum Queued {
    Memory { id: TransactionId, chunk: Chunk, base: u64 },
    Config { id: TransactionId, tlp: Tlp },
}

/// Tracks one requester's non-posted transactions. See the module docs for the call order.
#[derive(Debug)]
pub struct Requester {
    requester_id: Bdf,
    mrrs: usize,
    mps: usize,
    tags: TagAllocator,
    next_id: u64,
    transactions: HashMap<TransactionId, Transaction>,
    by_tag: HashMap<u16, Pending>,
    queued: VecDeque<Queued>,
    /// Posted writes, already built, in order with the requests queued before them.
    posted: VecDeque<(usize, Tlp)>,
    /// Queued requests handed out so far (orders posted writes after earlier reads).
    sequence: usize,
    events: VecDeque<RequesterEvent>,
    counters: RequesterCounters,
}

impl Requester {
    /// A requester with ID `requester_id`, `tag_count` tags (up to 1024), a completion
    /// `timeout`, and max read request / payload sizes in bytes (powers of two, 128..=4096).
    pub fn new(
        requester_id: Bdf,
        tag_count: u16,
        timeout: Duration,
        mrrs: usize,
        mps: usize,
    ) -> Result<Requester> {
        split(0, 1, mrrs)?;
        split(0, 1, mps)?;
        Ok(Requester {
            requester_id,
            mrrs,
            mps,
            tags: TagAllocator::new(tag_count, timeout),
            next_id: 0,
            transactions: HashMap::new(),
            by_tag: HashMap::new(),
            queued: VecDeque::new(),
            posted: VecDeque::new(),
            sequence: 0,
            events: VecDeque::new(),
            counters: RequesterCounters::default(),
        })
    }

    /// Changes the sizes requests are split by (for example once enumeration has programmed
    /// them); affects transactions started afterwards.
    pub fn set_sizes(&mut self, mrrs: usize, mps: usize) -> Result<()> {
        split(0, 1, mrrs)?;
        split(0, 1, mps)?;
        self.mrrs = mrrs;
        self.mps = mps;
        Ok(())
    }

    /// What went wrong so far.
    pub fn counters(&self) -> RequesterCounters {
        self.counters
    }

    /// Transactions not yet ended.
    pub fn in_flight(&self) -> usize {
        self.transactions.len()
    }

    fn new_transaction(&mut self, len: usize, parts: usize) -> TransactionId {
        let id = TransactionId(self.next_id);
        self.next_id += 1;
        self.transactions.insert(id, Transaction { data: vec![0; len], parts_left: parts, failed: false });
        id
    }

    /// Starts a memory read of `len` bytes at `address` (0 is a zero-length read).
    pub fn read(&mut self, address: u64, len: usize) -> Result<TransactionId> {
        let chunks = split(address, len, self.mrrs)?;
        let id = self.new_transaction(len, chunks.len());
        self.queued.extend(chunks.into_iter().map(|chunk| Queued::Memory { id, chunk, base: address }));
        Ok(id)
    }

    /// Queues a posted memory write of `bytes` at `address`, split by max payload size. It is sent
    /// after every request queued before it.
    pub fn write(&mut self, address: u64, bytes: &[u8]) -> Result<()> {
        let at = self.sequence + self.queued.len();
        for t in write_requests(self.requester_id, address, bytes, self.mps)? {
            self.posted.push_back((at, t));
        }
        Ok(())
    }

    /// Starts a type 0 configuration read of the DW at `register` of `target`.
    pub fn config_read(&mut self, target: Bdf, register: u16, first_be: u8) -> Result<TransactionId> {
        let tlp = Tlp::cfg_read(false, self.requester_id, crate::Tag::default(), target, register, first_be);
        tlp.check()?;
        let id = self.new_transaction(0, 1);
        self.queued.push_back(Queued::Config { id, tlp });
        Ok(id)
    }

    /// Starts a type 0 configuration write of one DW to `register` of `target`.
    pub fn config_write(
        &mut self,
        target: Bdf,
        register: u16,
        first_be: u8,
        value: [u8; 4],
    ) -> Result<TransactionId> {
        let tlp = Tlp::cfg_write(
            false,
            self.requester_id,
            crate::Tag::default(),
            target,
            register,
            first_be,
            value,
        );
        tlp.check()?;
        let id = self.new_transaction(0, 1);
        self.queued.push_back(Queued::Config { id, tlp });
        Ok(id)
    }

    /// The next TLP to send at `now`: posted writes in order, requests as tags allow.
    #[must_use]
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Tlp> {
        loop {
            if let Some((at, _)) = self.posted.front() {
                if *at <= self.sequence {
                    return self.posted.pop_front().map(|(_, t)| t);
                }
            }
            let id = match self.queued.front()? {
                Queued::Memory { id, .. } | Queued::Config { id, .. } => *id,
            };
            // Requests of a failed transaction are not sent.
            if self.transactions.get(&id).is_none_or(|t| t.failed) {
                self.queued.pop_front();
                self.sequence += 1;
                self.finish_part(id);
                continue;
            }
            let tag = self.tags.allocate(now)?;
            self.sequence += 1;
            let tlp = match self.queued.pop_front()? {
                Queued::Memory { id, chunk, base } => {
                    let s = chunk.shape();
                    let reassembly = ReadReassembly::new(self.requester_id, tag, chunk.address, chunk.len)
                        .expect("chunks are valid reads");
                    let offset = (chunk.address - base) as usize;
                    self.by_tag.insert(tag.get(), Pending { id, part: Part::Memory { offset, reassembly } });
                    Tlp::mem_read(self.requester_id, tag, s.address, s.length_dw, s.first_be, s.last_be)
                }
                Queued::Config { id, mut tlp } => {
                    tlp.tag = tag;
                    let write = tlp.kind == TlpKind::CfgWr0;
                    self.by_tag.insert(tag.get(), Pending { id, part: Part::Config { write } });
                    tlp
                }
            };
            return Some(tlp);
        }
    }

    /// One part of transaction `id` is over (successfully or not); ends it when all are.
    fn finish_part(&mut self, id: TransactionId) {
        let Some(t) = self.transactions.get_mut(&id) else { return };
        t.parts_left = t.parts_left.saturating_sub(1);
        if t.parts_left == 0 {
            let t = self.transactions.remove(&id).expect("present");
            if !t.failed {
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

    /// Takes a completion addressed to this requester. An error means the completion was not
    /// applied and was counted: unexpected (no such tag, not a completion) or inconsistent with
    /// its request (the request stays outstanding: the right completions may still come, or the
    /// timeout ends it). A completion status other than success ends the transaction with
    /// [`RequesterEvent::Failed`]; that is not an error here.
    pub fn handle_completion(&mut self, cpl: &Tlp) -> Result<()> {
        let tag = cpl.tag;
        let pending = match &cpl.header {
            Header::Completion(h) if h.requester_id == self.requester_id => self.by_tag.remove(&tag.get()),
            _ => None,
        };
        let Some(mut pending) = pending else {
            self.counters.unexpected_completions += 1;
            return Err(Error::UnexpectedCompletion("no request outstanding with this tag"));
        };
        let id = pending.id;
        let step: Result<bool> = match &mut pending.part {
            Part::Memory { reassembly, .. } => {
                reassembly.handle_completion(cpl).map(|p| p == Progress::Complete)
            }
            Part::Config { write } => {
                let Header::Completion(h) = &cpl.header else { unreachable!("matched above") };
                match (h.status, *write, cpl.kind, cpl.data.len()) {
                    (CplStatus::Success, true, TlpKind::Cpl, _) => Ok(true),
                    (CplStatus::Success, false, TlpKind::CplD, 4) => {
                        if let Some(t) = self.transactions.get_mut(&id) {
                            t.data = cpl.data.clone();
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
                self.by_tag.insert(tag.get(), pending);
                Ok(())
            }
            Ok(true) => {
                if let Part::Memory { offset, reassembly } = pending.part {
                    match reassembly.into_data() {
                        Ok(d) => {
                            if let Some(t) = self.transactions.get_mut(&id) {
                                t.data[offset..offset + d.len()].copy_from_slice(&d);
                            }
                        }
                        Err(e) => self.fail(id, e),
                    }
                }
                self.tags.complete(tag);
                self.finish_part(id);
                Ok(())
            }
            Err(Error::CompletionStatus(status)) => {
                self.tags.complete(tag);
                self.fail(id, Error::CompletionStatus(status));
                self.finish_part(id);
                Ok(())
            }
            Err(e) => {
                self.by_tag.insert(tag.get(), pending);
                self.counters.unexpected_completions += 1;
                Err(e)
            }
        }
    }

    /// When the next tag times out.
    #[must_use]
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        self.tags.poll_timeout()
    }

    /// Fails the transactions whose completions did not arrive by `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(tag) = self.tags.poll_expired(now) {
            self.counters.timeouts += 1;
            if let Some(p) = self.by_tag.remove(&tag.get()) {
                self.fail(p.id, Error::CompletionTimeout);
                self.finish_part(p.id);
            }
        }
    }

    /// Fails every transaction at once (the completer is gone); their tags are freed.
    pub fn abort_all(&mut self, error: Error) {
        let ids: Vec<TransactionId> = self.transactions.keys().copied().collect();
        for id in ids {
            self.fail(id, error.clone());
        }
        for (tag, _) in self.by_tag.drain() {
            if let Some(t) = crate::Tag::new(tag) {
                self.tags.complete(t);
            }
        }
        self.transactions.clear();
        self.queued.clear();
        self.posted.clear();
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
    use crate::Tag;
    use rand::{Rng, SeedableRng};

    const ME: Bdf = Bdf(0x0000);
    const DEV: Bdf = Bdf(0x0300);
    const MS: Duration = Duration::from_millis(1);

    fn memory() -> Vec<u8> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        (0..65536).map(|_| rng.random()).collect()
    }

    /// Answers every read the requester sends from `mem`, tags interleaved at random (each
    /// tag's completions in order, as PCIe requires).
    fn serve(r: &mut Requester, mem: &[u8], now: Instant, rng: &mut impl Rng) -> Vec<Tlp> {
        let mut per_tag = vec![];
        let mut writes = vec![];
        while let Some(t) = r.poll_transmit(now) {
            match t.kind {
                TlpKind::MRd32 | TlpKind::MRd64 => {
                    let cpls = completions_for_read(&t, DEV, 256, 64, |a, buf| {
                        buf.copy_from_slice(&mem[a as usize..a as usize + buf.len()]);
                        Ok(())
                    })
                    .unwrap();
                    per_tag.push(VecDeque::from(cpls));
                }
                _ => writes.push(t),
            }
        }
        while !per_tag.is_empty() {
            let i = rng.random_range(0..per_tag.len());
            let c = per_tag[i].pop_front().unwrap();
            r.handle_completion(&Tlp::decode(&c.encode().unwrap()).unwrap()).unwrap();
            if per_tag[i].is_empty() {
                per_tag.swap_remove(i);
            }
        }
        writes
    }

    #[test]
    fn reads_of_any_length_with_few_tags() {
        let mem = memory();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let mut r = Requester::new(ME, 8, 10 * MS, 512, 256).unwrap();
        let reads = [(0x1003u64, 10_000usize), (0, 0), (0x7fff, 1), (0x100, 4096), (0xfff0, 16)];
        let ids: Vec<_> = reads.iter().map(|&(a, l)| r.read(a, l).unwrap()).collect();
        let mut done = HashMap::new();
        let mut rounds = 0;
        while r.in_flight() > 0 {
            serve(&mut r, &mem, Instant::ZERO, &mut rng);
            while let Some(e) = r.poll_event() {
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
    fn posted_writes_keep_program_order() {
        let mut r = Requester::new(ME, 32, 10 * MS, 128, 128).unwrap();
        r.write(0x100, &[1; 300]).unwrap();
        r.read(0x2000, 8).unwrap();
        r.write(0x3000, &[2; 4]).unwrap();
        let kinds: Vec<TlpKind> =
            std::iter::from_fn(|| r.poll_transmit(Instant::ZERO)).map(|t| t.kind).collect();
        use TlpKind::*;
        assert_eq!(kinds, vec![MWr32, MWr32, MWr32, MRd32, MWr32]);
    }

    #[test]
    fn enumerates_a_function_through_config_tlps() {
        let mut f = Function::new(DmaEngine::new()).unwrap();
        let mut r = Requester::new(ME, 32, 10 * MS, 512, 256).unwrap();
        let mut exchange = |r: &mut Requester| {
            while let Some(t) = r.poll_transmit(Instant::ZERO) {
                for c in f.handle_request(&Tlp::decode(&t.encode().unwrap()).unwrap()).unwrap() {
                    r.handle_completion(&c).unwrap();
                }
            }
            std::iter::from_fn(|| r.poll_event()).collect::<Vec<_>>()
        };
        let ids = r.config_read(DEV, 0, 0xf).unwrap();
        let size =
            [r.config_write(DEV, 0x10, 0xf, [0xff; 4]).unwrap(), r.config_read(DEV, 0x10, 0xf).unwrap()];
        let ev = exchange(&mut r);
        assert_eq!(ev[0], RequesterEvent::Done { id: ids, data: vec![0x42, 0x4c, 0x01, 0x00] });
        assert_eq!(ev[1], RequesterEvent::Done { id: size[0], data: vec![] });
        assert_eq!(ev[2], RequesterEvent::Done { id: size[1], data: 0xffff_f000u32.to_le_bytes().to_vec() });
        // Type 1 to an endpoint is refused: the transaction fails with UR.
        let mut t1 = r.config_read(DEV, 0, 0xf).unwrap();
        if let Some(Queued::Config { tlp, .. }) = r.queued.back_mut() {
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
        t1 = r.read(0xdead_0000, 4).unwrap();
        while let Some(t) = r.poll_transmit(Instant::ZERO) {
            for c in f.handle_request(&t).unwrap() {
                r.handle_completion(&c).unwrap();
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
        let mut r = Requester::new(ME, 4, 10 * MS, 512, 256).unwrap();
        let t0 = Instant::ZERO;
        let id = r.read(0x400, 1024).unwrap();
        let reqs: Vec<Tlp> = std::iter::from_fn(|| r.poll_transmit(t0)).collect();
        assert_eq!(reqs.len(), 2);
        assert_eq!(r.poll_timeout(), Some(t0 + 10 * MS));
        let serve_one = |t: &Tlp| {
            completions_for_read(t, DEV, 512, 64, |a, buf| {
                buf.copy_from_slice(&mem[a as usize..a as usize + buf.len()]);
                Ok(())
            })
            .unwrap()
        };
        // The first half answered, with a lying completion and a stranger's thrown in first.
        let c0 = serve_one(&reqs[0]);
        let mut liar = c0[0].clone();
        liar.data.truncate(8);
        liar.length_dw = 2;
        if let Header::Completion(h) = &mut liar.header {
            h.lower_address = 8;
        }
        assert!(matches!(r.handle_completion(&liar), Err(Error::InconsistentCompletion(_))));
        let mut stranger = c0[0].clone();
        stranger.tag = Tag::new(3).unwrap();
        assert!(matches!(r.handle_completion(&stranger), Err(Error::UnexpectedCompletion(_))));
        for c in &c0 {
            r.handle_completion(c).unwrap();
        }
        assert_eq!(r.poll_event(), None);
        // The second half never comes.
        r.handle_timeout(t0 + 9 * MS);
        assert_eq!(r.poll_event(), None);
        r.handle_timeout(t0 + 10 * MS);
        assert_eq!(r.poll_event(), Some(RequesterEvent::Failed { id, error: Error::CompletionTimeout }));
        assert_eq!(r.in_flight(), 0);
        // Too late now.
        let late = serve_one(&reqs[1]);
        assert!(r.handle_completion(&late[0]).is_err());
        let c = r.counters();
        assert_eq!((c.unexpected_completions, c.timeouts), (3, 1));

        // A completer that goes away.
        let id = r.read(0, 100).unwrap();
        let _ = r.poll_transmit(t0);
        r.abort_all(Error::Unreachable("heartbeats stopped".into()));
        let ev = r.poll_event();
        assert!(
            matches!(ev, Some(RequesterEvent::Failed { id: i, error: Error::Unreachable(_) }) if i == id)
        );
        assert_eq!((r.in_flight(), r.poll_timeout()), (0, None));
    }

    proptest::proptest! {
        // Random reads, random interleaving: every transaction ends once with the right bytes.
        #[test]
        fn matches_memory(seed in proptest::num::u64::ANY, n in 1usize..6) {
            let mem = memory();
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let mut r = Requester::new(ME, 16, 10 * MS, 128 << rng.random_range(0..6), 256).unwrap();
            let mut want = HashMap::new();
            for _ in 0..n {
                let a = rng.random_range(0..60000u64);
                let l = rng.random_range(0..5000usize);
                want.insert(r.read(a, l).unwrap(), mem[a as usize..a as usize + l].to_vec());
            }
            let mut rounds = 0;
            while r.in_flight() > 0 && rounds < 1000 {
                serve(&mut r, &mem, Instant::ZERO, &mut rng);
                rounds += 1;
            }
            let events: Vec<_> = std::iter::from_fn(|| r.poll_event()).collect();
            proptest::prop_assert_eq!(events.len(), n);
            for e in events {
                let RequesterEvent::Done { id, data } = e else { panic!("{e:?}") };
                proptest::prop_assert_eq!(&data, &want[&id]);
            }
        }
    }
}
