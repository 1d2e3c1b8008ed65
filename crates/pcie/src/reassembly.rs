//! Putting a memory read's completions back together.
//!
//! Layer: pcie engine, requester side; sans-IO plain state. Implements the requester's checks of
//! PCIe Base Specification 2.2.9 and 2.3.1.1: completions for one request arrive in address
//! order; each carries the bytes left (Byte Count, this completion included) and the low 7 bits
//! of the address of its first byte (Lower Address); its data starts at that byte's DW.
//!
//! Invariants: every completion is distrusted: one that does not match the read's requester and
//! tag, contradicts the byte count or lower address expected next, returns more DWs than are
//! left, or arrives after the read is done gives an error and leaves the state unchanged; one
//! with a status other than Successful Completion fails the read. Nothing here panics.

use crate::tlp::{Bdf, CplStatus, Header, Tag, Tlp, TlpKind};
use crate::{Error, Result};

/// What a completion did to the read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Progress {
    /// More completions are due.
    Partial,
    /// All bytes are in.
    Complete,
}

/// A memory read being reassembled: `len` bytes at byte address `address`, requested by
/// `requester_id` with `tag` as one request (so at most 4096 bytes, not crossing 4 KiB).
#[derive(Debug, Clone)]
pub struct ReadReassembly {
    requester_id: Bdf,
    tag: Tag,
    address: u64,
    /// Bytes requested.
    len: usize,
    /// Bytes received so far (the next expected byte is `address + received`).
    received: usize,
    /// The bytes received, in order (completions of one request arrive in address order).
    data: Vec<u8>,
    failed: Option<CplStatus>,
    done: bool,
}

impl ReadReassembly {
    /// Expects the completions for a read of `len` bytes at `address` (`len` 0 is the
    /// zero-length read, answered by one DW that is discarded).
    pub fn new(requester_id: Bdf, tag: Tag, address: u64, len: usize) -> Result<ReadReassembly> {
        crate::request::RequestShape::for_range(address, len)?;
        Ok(ReadReassembly {
            requester_id,
            tag,
            address,
            len,
            received: 0,
            data: Vec::with_capacity(len),
            failed: None,
            done: false,
        })
    }

    /// The tag the completions carry.
    pub fn tag(&self) -> Tag {
        self.tag
    }

    /// Whether every byte has arrived.
    pub fn is_complete(&self) -> bool {
        self.done && self.failed.is_none()
    }

    /// Bytes received so far.
    pub fn received(&self) -> usize {
        self.received
    }

    /// Takes one completion. Errors leave the reassembly as it was, except a non-successful
    /// status, which ends the read ([`Error::CompletionStatus`]; later completions are
    /// unexpected).
    pub fn handle_completion(&mut self, cpl: &Tlp) -> Result<Progress> {
        self.handle_completion_payload(cpl, &cpl.data)
    }

    /// [`handle_completion`](Self::handle_completion) for a completion decoded in place
    /// ([`Tlp::decode_borrowed`]): its `data` left empty, its `payload` still in the frame, copied
    /// once, to where it goes.
    pub fn handle_completion_payload(&mut self, cpl: &Tlp, payload: &[u8]) -> Result<Progress> {
        let Header::Completion(h) = &cpl.header else {
            return Err(Error::UnexpectedCompletion("not a completion"));
        };
        if h.requester_id != self.requester_id || cpl.tag != self.tag {
            return Err(Error::UnexpectedCompletion("requester ID or tag of another request"));
        }
        if self.done || self.failed.is_some() {
            return Err(Error::UnexpectedCompletion("the read is already finished"));
        }
        if h.status != CplStatus::Success {
            if cpl.kind != TlpKind::Cpl {
                return Err(Error::InconsistentCompletion("unsuccessful completion with data"));
            }
            self.failed = Some(h.status);
            return Err(Error::CompletionStatus(h.status));
        }
        if cpl.kind != TlpKind::CplD {
            return Err(Error::InconsistentCompletion("successful read completion without data"));
        }
        let len = self.len;
        let cur = self.address + self.received as u64;
        let (want_bc, want_la) = if len == 0 {
            (1, (self.address & 0x7c) as u8)
        } else {
            (len - self.received, (cur & 0x7f) as u8)
        };
        if !h.bcm && usize::from(h.byte_count) != want_bc {
            return Err(Error::InconsistentCompletion("byte count is not the bytes left"));
        }
        if h.lower_address != want_la {
            return Err(Error::InconsistentCompletion("lower address is not the next byte's"));
        }
        let start_dw = cur & !3;
        let end = self.address + len as u64;
        let end_dw = if len == 0 { start_dw + 4 } else { (end + 3) & !3 };
        let got_end = start_dw.saturating_add(payload.len() as u64);
        if got_end > end_dw {
            return Err(Error::InconsistentCompletion("more data than the read has left"));
        }
        if len == 0 {
            self.done = true;
            return Ok(Progress::Complete);
        }
        let upto = got_end.min(end);
        if upto <= cur {
            return Err(Error::InconsistentCompletion("completion returns no requested byte"));
        }
        let skip = (cur - start_dw) as usize;
        let n = (upto - cur) as usize;
        self.data.extend_from_slice(&payload[skip..skip + n]);
        self.received += n;
        if self.received == len {
            self.done = true;
            Ok(Progress::Complete)
        } else {
            Ok(Progress::Partial)
        }
    }

    /// The bytes read, once complete; otherwise the error that ended the read or says it is not
    /// finished.
    pub fn into_data(self) -> Result<Vec<u8>> {
        if let Some(s) = self.failed {
            return Err(Error::CompletionStatus(s));
        }
        if !self.done {
            return Err(Error::InconsistentCompletion("read not complete"));
        }
        Ok(self.data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{completions_for_read, read_requests};
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};

    fn memory() -> Vec<u8> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        (0..20480).map(|_| rng.random()).collect()
    }

    fn serve(mem: &[u8], rd: &Tlp, mps: usize, rcb: usize) -> Vec<Tlp> {
        completions_for_read(rd, Bdf(0x300), mps, rcb, |a, buf| {
            let a = a as usize;
            buf.copy_from_slice(mem.get(a..a + buf.len()).ok_or(())?);
            Ok(())
        })
        .unwrap()
    }

    proptest! {
        #[test]
        fn roundtrip(addr in 0u64..12000, len in 0usize..5000, mrrs_pow in 7u32..=12, mps_pow in 7u32..=9,
                     rcb in prop::sample::select(vec![64usize, 128])) {
            let mem = memory();
            let mut tag = 0u16;
            let reqs = read_requests(Bdf(0x100), addr, len, 1 << mrrs_pow, || {
                tag += 1;
                Ok(Tag::new(tag).unwrap())
            }).unwrap();
            let mut out = vec![];
            for (chunk, rd) in &reqs {
                let wire = Tlp::decode(&rd.encode().unwrap()).unwrap();
                let mut r = ReadReassembly::new(Bdf(0x100), rd.tag, chunk.address, chunk.len).unwrap();
                let cpls = serve(&mem, &wire, 1 << mps_pow, rcb);
                for (i, c) in cpls.iter().enumerate() {
                    let c = Tlp::decode(&c.encode().unwrap()).unwrap();
                    let p = r.handle_completion(&c).unwrap();
                    prop_assert_eq!(p == Progress::Complete, i + 1 == cpls.len());
                }
                prop_assert!(r.handle_completion(&cpls[0]).is_err());
                out.extend(r.into_data().unwrap());
            }
            prop_assert_eq!(&out[..], &mem[addr as usize..addr as usize + len]);
        }
    }

    #[test]
    fn rejects_inconsistent_and_unexpected() {
        let mem = memory();
        let tag = Tag::new(9).unwrap();
        let rd = Tlp::mem_read(Bdf(1), tag, 0x100, 64, 0xf, 0xf);
        let cpls = serve(&mem, &rd, 128, 64);
        assert_eq!(cpls.len(), 2);
        let fresh = || ReadReassembly::new(Bdf(1), tag, 0x100, 256).unwrap();

        // Out of order: the second completion first.
        let mut r = fresh();
        assert!(matches!(r.handle_completion(&cpls[1]), Err(Error::InconsistentCompletion(_))));
        // Wrong tag, wrong requester, a request instead of a completion.
        let mut c = cpls[0].clone();
        c.tag = Tag::new(10).unwrap();
        assert!(matches!(r.handle_completion(&c), Err(Error::UnexpectedCompletion(_))));
        let mut c = cpls[0].clone();
        if let Header::Completion(h) = &mut c.header {
            h.requester_id = Bdf(2);
        }
        assert!(matches!(r.handle_completion(&c), Err(Error::UnexpectedCompletion(_))));
        assert!(matches!(r.handle_completion(&rd), Err(Error::UnexpectedCompletion(_))));
        // Byte count and lower address lies; too much data.
        for f in [
            |h: &mut crate::CompletionHeader| h.byte_count -= 4,
            |h: &mut crate::CompletionHeader| h.lower_address = 4,
        ] {
            let mut c = cpls[0].clone();
            if let Header::Completion(h) = &mut c.header {
                f(h);
            }
            assert!(matches!(r.handle_completion(&c), Err(Error::InconsistentCompletion(_))));
        }
        let mut c = cpls[0].clone();
        c.data.extend([0; 256]);
        c.length_dw = (c.data.len() / 4) as u16;
        assert!(matches!(r.handle_completion(&c), Err(Error::InconsistentCompletion(_))));
        // State unchanged by all that: the right sequence still completes.
        assert_eq!(r.handle_completion(&cpls[0]), Ok(Progress::Partial));
        assert_eq!(r.handle_completion(&cpls[1]), Ok(Progress::Complete));
        assert!(matches!(r.handle_completion(&cpls[1]), Err(Error::UnexpectedCompletion(_))));
        assert_eq!(r.into_data().unwrap(), &mem[0x100..0x200]);

        // Unsupported Request ends the read.
        let mut r = fresh();
        let ur = Tlp::completion(Bdf(0x300), Bdf(1), tag, CplStatus::UnsupportedRequest, 256, 0, vec![]);
        assert_eq!(r.handle_completion(&ur), Err(Error::CompletionStatus(CplStatus::UnsupportedRequest)));
        assert!(r.handle_completion(&cpls[0]).is_err());
        assert_eq!(r.into_data(), Err(Error::CompletionStatus(CplStatus::UnsupportedRequest)));
        // Unfinished.
        assert!(fresh().into_data().is_err());
    }

    #[test]
    fn zero_length_read() {
        let tag = Tag::new(1).unwrap();
        let rd = Tlp::mem_read(Bdf(1), tag, 0x40, 1, 0, 0);
        let cpls = serve(&memory(), &rd, 128, 64);
        assert_eq!(cpls.len(), 1);
        let Header::Completion(h) = cpls[0].header else { panic!() };
        assert_eq!((h.byte_count, h.lower_address, cpls[0].length_dw), (1, 0x40, 1));
        let mut r = ReadReassembly::new(Bdf(1), tag, 0x40, 0).unwrap();
        assert_eq!(r.handle_completion(&cpls[0]), Ok(Progress::Complete));
        assert_eq!(r.into_data().unwrap(), Vec::<u8>::new());
    }
}
