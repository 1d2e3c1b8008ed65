//! Memory requests from byte ranges, and read completions from requests.
//!
//! Layer: pcie engine, pure functions. Implements PCIe Base Specification 2.2.5 (first/last DW
//! byte enable rules, zero-length reads), 2.2.7 (a request never crosses a 4 KiB boundary,
//! Max_Payload_Size for writes, Max_Read_Request_Size for reads) and 2.3.1.1 (read completions
//! cut at Read Completion Boundaries), with the policy the shared vectors fix: completions are
//! as large as max payload size allows, and a cut completion ends so that the next one starts on
//! a read completion boundary.
//!
//! Chunking policy for requests: chunks end at multiples of the size limit (MPS or MRRS, powers
//! of two up to 4096), so every chunk fits the limit in DWs and none crosses 4 KiB.

use crate::tlp::{Bdf, CplStatus, Header, MemHeader, Tag, Tlp, TlpKind};
use crate::{Error, Result};

/// The DW-level shape of a memory request for a byte range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestShape {
    /// DW-aligned address of the first DW.
    pub address: u64,
    /// Length in DW (1..=1024).
    pub length_dw: u16,
    /// First DW byte enables.
    pub first_be: u8,
    /// Last DW byte enables (0 when `length_dw` is 1).
    pub last_be: u8,
}

impl RequestShape {
    /// The shape a memory request's header and DW length describe.
    pub fn of_memory(header: &MemHeader, length_dw: u16) -> RequestShape {
        RequestShape {
            address: header.address,
            length_dw,
            first_be: header.first_be,
            last_be: header.last_be,
        }
    }

    /// The shape of a request for `len` bytes at byte address `address`. A zero `len` gives the
    /// zero-length read/write (1 DW, no bytes enabled). Fails if the range is longer than
    /// 4096 bytes, crosses a 4 KiB boundary, or wraps the address space.
    pub fn for_range(address: u64, len: usize) -> Result<RequestShape> {
        let start = address & !3;
        let too_high = || Error::BadRequest(format!("{len} bytes at {address:#x} reach past 2^64 - 4"));
        if len == 0 {
            start.checked_add(4).ok_or_else(too_high)?;
            return Ok(RequestShape { address: start, length_dw: 1, first_be: 0, last_be: 0 });
        }
        if len > 4096 {
            return Err(Error::BadRequest(format!("{len} bytes do not fit one request")));
        }
        // The DW-rounded end must be representable, so arithmetic on DW ends never overflows.
        let end =
            address.checked_add(len as u64).filter(|e| e.checked_add(3).is_some()).ok_or_else(too_high)?;
        if (address >> 12) != ((end - 1) >> 12) {
            return Err(Error::BadRequest(format!("{len} bytes at {address:#x} cross a 4 KiB boundary")));
        }
        let end_dw = (end + 3) & !3;
        let length_dw = ((end_dw - start) / 4) as u16;
        let first_be = (0xfu8 << (address & 3)) & 0xf;
        let last_be = 0xfu8 >> ((4 - (end & 3)) & 3);
        Ok(if length_dw == 1 {
            RequestShape { address: start, length_dw, first_be: first_be & last_be, last_be: 0 }
        } else {
            RequestShape { address: start, length_dw, first_be, last_be }
        })
    }

    /// The byte range a memory request covers, from its DW length and byte enables: (offset of
    /// the first enabled byte from `address`, byte count), as in the spec's byte count table
    /// (2.2.9). A request with no byte enabled (zero-length read) gives (0, 0).
    pub fn byte_range(&self) -> (u64, usize) {
        let lead = |be: u8| u64::from(be.trailing_zeros().min(4));
        if self.length_dw == 1 {
            if self.first_be & 0xf == 0 {
                return (0, 0);
            }
            let first = self.first_be.trailing_zeros();
            let last = 7 - (self.first_be & 0xf).leading_zeros();
            return (u64::from(first), (last - first + 1) as usize);
        }
        let first = lead(self.first_be);
        let trailing = if self.last_be & 0xf == 0 { 4 } else { (self.last_be & 0xf).leading_zeros() - 4 };
        let total = u64::from(self.length_dw) * 4 - first - u64::from(trailing);
        (first, total as usize)
    }
}

/// A piece of a larger transfer that fits one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Chunk {
    /// Byte address of the piece.
    pub address: u64,
    /// Offset of the piece in the caller's buffer.
    pub offset: usize,
    /// Bytes in the piece.
    pub len: usize,
}

impl Chunk {
    /// The request shape for this piece.
    pub fn shape(&self) -> RequestShape {
        RequestShape::for_range(self.address, self.len).expect("chunks fit one request")
    }
}

fn check_rcb(rcb: usize) -> Result<u64> {
    if rcb != 64 && rcb != 128 {
        return Err(Error::BadRequest(format!("read completion boundary {rcb} is not 64 or 128")));
    }
    Ok(rcb as u64)
}

fn check_limit(limit: usize) -> Result<u64> {
    if !limit.is_power_of_two() || !(128..=4096).contains(&limit) {
        return Err(Error::BadRequest(format!("size limit {limit} is not a power of two in 128..=4096")));
    }
    Ok(limit as u64)
}

/// Splits `len` bytes at `address` into pieces of at most `limit` bytes (MPS for writes, MRRS
/// for reads), each ending on a multiple of `limit` so that it fits `limit / 4` DWs and never
/// crosses 4 KiB. A zero `len` gives one zero-length piece. Fails, as [`RequestShape::for_range`]
/// does, for a range whose DW-rounded end is past 2^64 - 4, so every piece has a shape.
pub fn split(address: u64, len: usize, limit: usize) -> Result<Vec<Chunk>> {
    let limit = check_limit(limit)?;
    let dw_end = if len == 0 { (address & !3).checked_add(4) } else { address.checked_add(len as u64 + 3) };
    let end = dw_end
        .map(|_| address.wrapping_add(len as u64))
        .ok_or_else(|| Error::BadRequest(format!("{len} bytes at {address:#x} reach past 2^64 - 4")))?;
    if len == 0 {
        return Ok(vec![Chunk { address, offset: 0, len: 0 }]);
    }
    let mut out = Vec::with_capacity((len as u64 / limit + 2) as usize);
    let mut cur = address;
    while cur < end {
        let boundary = (cur / limit + 1).saturating_mul(limit);
        let next = boundary.min(end);
        out.push(Chunk { address: cur, offset: (cur - address) as usize, len: (next - cur) as usize });
        cur = next;
    }
    Ok(out)
}

/// Memory read requests for `len` bytes at `address`, at most `mrrs` bytes each; tags come from
/// `next_tag` (which may fail, for example when no tag is free).
pub fn read_requests(
    requester_id: Bdf,
    address: u64,
    len: usize,
    mrrs: usize,
    mut next_tag: impl FnMut() -> Result<Tag>,
) -> Result<Vec<(Chunk, Tlp)>> {
    split(address, len, mrrs)?
        .into_iter()
        .map(|c| {
            let s = c.shape();
            Ok((c, Tlp::mem_read(requester_id, next_tag()?, s.address, s.length_dw, s.first_be, s.last_be)))
        })
        .collect()
}

/// The payload of a write of `bytes` at byte address `address` (at most one request's worth):
/// whole DWs, the bytes placed at their offsets, disabled bytes zero.
pub fn write_payload(address: u64, bytes: &[u8]) -> Result<(RequestShape, Vec<u8>)> {
    let s = RequestShape::for_range(address, bytes.len())?;
    let mut data = vec![0u8; usize::from(s.length_dw) * 4];
    let off = (address & 3) as usize;
    data[off..off + bytes.len()].copy_from_slice(bytes);
    Ok((s, data))
}

/// Memory write requests for `bytes` at `address`, at most `mps` bytes of payload each.
pub fn write_requests(requester_id: Bdf, address: u64, bytes: &[u8], mps: usize) -> Result<Vec<Tlp>> {
    split(address, bytes.len(), mps)?
        .into_iter()
        .map(|c| {
            let (s, data) = write_payload(c.address, &bytes[c.offset..c.offset + c.len])?;
            Ok(Tlp::mem_write(requester_id, s.address, s.first_be, s.last_be, data))
        })
        .collect()
}

/// One completion of a split read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CompletionPiece {
    /// DW-aligned address of the first DW this completion returns.
    pub address: u64,
    /// DWs returned.
    pub length_dw: u16,
    /// Bytes left to return, this completion included (1..=4096; 1 for a zero-length read).
    pub byte_count: u16,
    /// Low 7 bits of the byte address of the first byte returned.
    pub lower_address: u8,
}

/// How a completer splits the completions for a memory read of `len` bytes at byte address
/// `address` (one request's worth: at most 4096 bytes, not crossing 4 KiB), with max payload
/// size `mps` and read completion boundary `rcb` (64 or 128) in bytes.
pub fn split_completions(address: u64, len: usize, mps: usize, rcb: usize) -> Result<Vec<CompletionPiece>> {
    let mps = check_limit(mps)?;
    let rcb = check_rcb(rcb)?;
    if len == 0 {
        RequestShape::for_range(address, 0)?;
        let a = address & !3;
        return Ok(vec![CompletionPiece {
            address: a,
            length_dw: 1,
            byte_count: 1,
            lower_address: (a & 0x7f) as u8,
        }]);
    }
    RequestShape::for_range(address, len)?;
    let end = address + len as u64;
    let end_dw = (end + 3) & !3;
    let mut out = Vec::new();
    let mut cur = address;
    loop {
        let start_dw = cur & !3;
        let piece = |to: u64| CompletionPiece {
            address: start_dw,
            length_dw: ((to - start_dw) / 4) as u16,
            byte_count: (end - cur) as u16,
            lower_address: (cur & 0x7f) as u8,
        };
        if end_dw - start_dw <= mps {
            out.push(piece(end_dw));
            return Ok(out);
        }
        let mut cut = (start_dw + mps) / rcb * rcb;
        if cut <= start_dw {
            cut = start_dw + mps;
        }
        out.push(piece(cut));
        cur = cut;
    }
}

/// A memory read request's header, the address of its first enabled byte and its byte count, once
/// the completer's max payload size and read completion boundary are known to be valid.
fn read_request(request: &Tlp, mps: usize, rcb: usize) -> Result<(&MemHeader, u64, usize)> {
    let (TlpKind::MRd32 | TlpKind::MRd64, Header::Mem(h)) = (request.kind, &request.header) else {
        return Err(Error::BadRequest(format!("{} is not a memory read", request.kind)));
    };
    let (first, len) = RequestShape::of_memory(h, request.length_dw).byte_range();
    check_limit(mps)?;
    check_rcb(rcb)?;
    Ok((h, h.address.saturating_add(first), len))
}

/// The successful completion carrying piece `p` of `request`'s data: traffic class and the No
/// Snoop and Relaxed Ordering attributes copied from the request.
fn success_completion(
    request: &Tlp,
    h: &MemHeader,
    completer_id: Bdf,
    p: &CompletionPiece,
    data: Vec<u8>,
) -> Tlp {
    let mut c = Tlp::completion(
        completer_id,
        h.requester_id,
        request.tag,
        CplStatus::Success,
        p.byte_count,
        p.lower_address,
        data,
    );
    c.tc = request.tc;
    c.attr =
        crate::tlp::Attr(request.attr.0 & (crate::tlp::Attr::NO_SNOOP | crate::tlp::Attr::RELAXED_ORDERING));
    c
}

/// The completions a completer returns for a memory read request `request`, split as in
/// [`split_completions`]; `read` fills the bytes of a DW-aligned range of memory (its length a
/// multiple of 4) or fails, in which case a single Completer Abort completion is returned
/// instead. A request that is not a memory read is an error.
pub fn completions_for_read(
    request: &Tlp,
    completer_id: Bdf,
    mps: usize,
    rcb: usize,
    mut read: impl FnMut(u64, &mut [u8]) -> core::result::Result<(), ()>,
) -> Result<Vec<Tlp>> {
    let (h, address, len) = read_request(request, mps, rcb)?;
    // With valid sizes, only a malformed range (crossing 4 KiB, wrapping) fails: that gets an
    // abort rather than data.
    let pieces =
        split_completions(if len == 0 { h.address } else { address }, len, mps, rcb).unwrap_or_default();
    let mut out = Vec::with_capacity(pieces.len());
    for p in &pieces {
        let mut data = vec![0u8; usize::from(p.length_dw) * 4];
        if read(p.address, &mut data).is_err() {
            out.clear();
            break;
        }
        out.push(success_completion(request, h, completer_id, p, data));
    }
    if out.is_empty() {
        let lower = (address & 0x7f) as u8;
        let bc = len.clamp(1, 4096) as u16;
        let mut c = Tlp::completion(
            completer_id,
            h.requester_id,
            request.tag,
            CplStatus::CompleterAbort,
            bc,
            lower,
            vec![],
        );
        c.tc = request.tc;
        out.push(c);
    }
    Ok(out)
}

/// Buffers [`each_completion_for_read`] reuses from call to call.
#[derive(Debug, Default)]
pub struct CompletionScratch {
    data: Vec<u8>,
}

/// [`completions_for_read`] handing each completion to `emit` in order instead of collecting
/// them: `emit` gets the completion without its payload (`data` empty; `kind` and `length_dw`
/// those of the whole TLP, so [`Tlp::emit_header`] writes its header) and the payload, a slice of
/// `scratch`'s reused buffer. A caller that copies both into a message copies every byte once; no
/// allocation per completion once the buffer has grown. Same completions, same errors: every piece
/// is read before the first is emitted, and a read that fails, or a request that needs no data,
/// takes [`completions_for_read`]'s own path.
pub fn each_completion_for_read(
    request: &Tlp,
    completer_id: Bdf,
    mps: usize,
    rcb: usize,
    scratch: &mut CompletionScratch,
    mut read: impl FnMut(u64, &mut [u8]) -> core::result::Result<(), ()>,
    mut emit: impl FnMut(&Tlp, &[u8]),
) -> Result<()> {
    let (h, address, len) = read_request(request, mps, rcb)?;
    let pieces =
        if len == 0 { Vec::new() } else { split_completions(address, len, mps, rcb).unwrap_or_default() };
    let total: usize = pieces.iter().map(|p| usize::from(p.length_dw) * 4).sum();
    // Grown, never cleared: `read` overwrites every byte of the pieces it fills.
    if scratch.data.len() < total {
        scratch.data.resize(total, 0);
    }
    let data = &mut scratch.data[..total];
    let mut at = 0;
    let mut read_all = !pieces.is_empty();
    for p in &pieces {
        let n = usize::from(p.length_dw) * 4;
        if read(p.address, &mut data[at..at + n]).is_err() {
            read_all = false;
            break;
        }
        at += n;
    }
    if !read_all {
        for mut c in completions_for_read(request, completer_id, mps, rcb, read)? {
            let payload = core::mem::take(&mut c.data);
            emit(&c, &payload);
        }
        return Ok(());
    }
    let mut at = 0;
    for p in &pieces {
        let n = usize::from(p.length_dw) * 4;
        let mut c = success_completion(request, h, completer_id, p, Vec::new());
        c.kind = TlpKind::CplD;
        c.length_dw = p.length_dw;
        emit(&c, &data[at..at + n]);
        at += n;
    }
    Ok(())
}

/// The completions of a successful read without their payloads, for a completer that copies each
/// payload itself straight to where it goes: each completion as [`each_completion_for_read`]
/// hands it over (`data` empty, `kind` CplD, `length_dw` its own, so [`Tlp::emit_header`] writes
/// its header), with the address and length of its payload (whole DWs). Empty for a read that
/// needs no data (zero length), which [`completions_for_read`] answers. Errors as its.
pub fn read_completion_headers(
    request: &Tlp,
    completer_id: Bdf,
    mps: usize,
    rcb: usize,
) -> Result<Vec<(Tlp, u64, usize)>> {
    let (h, address, len) = read_request(request, mps, rcb)?;
    if len == 0 {
        return Ok(Vec::new());
    }
    let pieces = split_completions(address, len, mps, rcb)?;
    Ok(pieces
        .iter()
        .map(|p| {
            let mut c = success_completion(request, h, completer_id, p, Vec::new());
            c.kind = TlpKind::CplD;
            c.length_dw = p.length_dw;
            (c, p.address, usize::from(p.length_dw) * 4)
        })
        .collect())
}

/// The completion that refuses a request with `status` (Unsupported Request, Completer Abort):
/// `None` for posted requests (memory writes) and completions, which get no answer. The byte
/// count is the read's for memory reads and 4 otherwise, as for the first completion of a
/// successful answer (PCIe 2.2.9).
pub fn refuse(request: &Tlp, completer_id: Bdf, status: CplStatus) -> Option<Tlp> {
    if !request.kind.is_non_posted() {
        return None;
    }
    let (byte_count, lower_address) = match (request.kind, &request.header) {
        (TlpKind::MRd32 | TlpKind::MRd64, Header::Mem(h)) => {
            let s = RequestShape::of_memory(h, request.length_dw);
            let (first, len) = s.byte_range();
            (len.clamp(1, 4096) as u16, (h.address.wrapping_add(first) & 0x7f) as u8)
        }
        _ => (4, 0),
    };
    let mut c = Tlp::completion(
        completer_id,
        request.requester_id(),
        request.tag,
        status,
        byte_count,
        lower_address,
        vec![],
    );
    c.tc = request.tc;
    c.attr = request.attr;
    Some(c)
}

/// The completion that refuses a non-posted TLP this codec does not model (locked reads,
/// AtomicOps) from its view, so that a requester is never left waiting: `None` for posted TLPs
/// (messages, writes) and completions.
pub fn refuse_packet<T: AsRef<[u8]>>(
    packet: &lanbus_wire::tlp::Packet<T>,
    completer_id: Bdf,
    status: CplStatus,
) -> Option<Tlp> {
    if !packet.tlp_type()?.is_non_posted() {
        return None;
    }
    let tag = Tag::new(packet.tag())?;
    let mut c = Tlp::completion(completer_id, Bdf(packet.requester_id()), tag, status, 4, 0, vec![]);
    c.tc = packet.tc();
    c.attr = crate::tlp::Attr(packet.attr());
    Some(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        let s = |a, l| RequestShape::for_range(a, l).unwrap();
        assert_eq!(s(0x1000, 4), RequestShape { address: 0x1000, length_dw: 1, first_be: 0xf, last_be: 0 });
        assert_eq!(s(0x1001, 2), RequestShape { address: 0x1000, length_dw: 1, first_be: 0x6, last_be: 0 });
        assert_eq!(s(0x1003, 2), RequestShape { address: 0x1000, length_dw: 2, first_be: 0x8, last_be: 0x1 });
        assert_eq!(s(0x1000, 0), RequestShape { address: 0x1000, length_dw: 1, first_be: 0, last_be: 0 });
        assert_eq!(s(0x1000, 4096).length_dw, 1024);
        assert!(RequestShape::for_range(0x1001, 4096).is_err());
        assert!(RequestShape::for_range(0xffe, 4).is_err());
        assert!(RequestShape::for_range(u64::MAX - 1, 4).is_err());
        for (a, l) in
            [(0x1001u64, 2usize), (0x1003, 2), (0x1000, 4096), (0x1002, 1), (0x17ff, 1), (0x1001, 9)]
        {
            assert_eq!(s(a, l).byte_range(), (a & 3, l), "{a:#x} {l}");
        }
        assert_eq!(s(0x1000, 0).byte_range(), (0, 0));
    }

    #[test]
    fn splits_never_cross_4k_nor_exceed_limit() {
        for (addr, len, limit) in
            [(0xffau64, 10000usize, 512usize), (0, 4096, 4096), (0x7f, 129, 128), (5, 0, 256)]
        {
            let chunks = split(addr, len, limit).unwrap();
            assert_eq!(chunks.iter().map(|c| c.len).sum::<usize>(), len);
            let mut next = addr;
            for c in &chunks {
                assert_eq!(c.address, next);
                assert_eq!(c.offset as u64, c.address - addr);
                next += c.len as u64;
                let s = c.shape();
                assert!(usize::from(s.length_dw) * 4 <= limit);
            }
        }
        assert!(split(0, 10, 100).is_err());
        // Near the top of the address space: every piece split off has a shape, or none is.
        for (addr, len) in
            [(u64::MAX - 0x573, 1393usize), (u64::MAX - 2, 0), (u64::MAX - 3, 1), (u64::MAX, 1)]
        {
            assert!(split(addr, len, 128).is_err(), "{addr:#x} {len}");
        }
        let top = split(u64::MAX - 0x1003, 0x1000, 128).unwrap();
        assert!(top.iter().all(|c| RequestShape::for_range(c.address, c.len).is_ok()));
    }

    proptest::proptest! {
        // Whatever the range, `split` either fails or gives pieces that all have a shape (the
        // bridges build requests from them without checking again).
        #[test]
        fn split_pieces_always_have_a_shape(
            address in proptest::prop_oneof![0u64..0x3000, (u64::MAX - 0x3000)..=u64::MAX],
            len in 0usize..9000,
            limit_log in 7u32..=12,
        ) {
            if let Ok(chunks) = split(address, len, 1 << limit_log) {
                for c in chunks {
                    proptest::prop_assert!(RequestShape::for_range(c.address, c.len).is_ok());
                }
            }
        }
    }

    #[test]
    fn write_requests_carry_the_bytes() {
        let bytes: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        // Across the 4 GiB line: 32-bit writes below it, 64-bit above.
        let tlps = write_requests(Bdf(1), 0xffff_fffe, &bytes, 256).unwrap();
        assert_eq!(tlps.iter().filter(|t| t.kind == TlpKind::MWr64).count(), 4);
        let mut mem = vec![0u8; 0x3000];
        let base = 0xffff_e000u64;
        for t in &tlps {
            let Header::Mem(h) = t.header else { panic!() };
            assert!(t.data.len() <= 256);
            assert_eq!(t.kind, if h.address >> 32 == 0 { TlpKind::MWr32 } else { TlpKind::MWr64 });
            for (i, b) in t.data.iter().enumerate() {
                let dw = i / 4;
                let be = if dw == 0 {
                    h.first_be
                } else if dw + 1 == usize::from(t.length_dw) {
                    h.last_be
                } else {
                    0xf
                };
                if be >> (i % 4) & 1 == 1 {
                    mem[(h.address - base) as usize + i] = *b;
                }
            }
            t.encode().unwrap();
        }
        assert_eq!(&mem[0x1ffe..0x1ffe + 1000], &bytes[..]);
    }

    proptest::proptest! {
        // Whatever read a peer sends, the completer answers without panicking: data that
        // reassembles, or one abort.
        #[test]
        fn any_read_request_is_answered(address in proptest::num::u64::ANY, length_dw in 1u16..=1024,
                                        first_be in 0u8..16, last_be in 0u8..16, mps_pow in 7u32..=12) {
            let rd = Tlp::mem_read(Bdf(1), Tag::new(3).unwrap(), address & !3, length_dw, first_be, last_be);
            let cpls = completions_for_read(&rd, Bdf(2), 1 << mps_pow, 64, |_, buf| {
                buf.fill(0xa5);
                Ok(())
            })
            .unwrap();
            proptest::prop_assert!(!cpls.is_empty());
            let shape = RequestShape { address: address & !3, length_dw, first_be, last_be };
            let (first, len) = shape.byte_range();
            let start = (address & !3).saturating_add(first);
            match crate::ReadReassembly::new(Bdf(1), Tag::new(3).unwrap(), start, len) {
                Ok(mut r) if cpls[0].kind == TlpKind::CplD => {
                    for c in &cpls {
                        let _ = r.handle_completion(c).unwrap();
                    }
                    proptest::prop_assert!(r.into_data().unwrap().iter().all(|b| *b == 0xa5));
                }
                _ => proptest::prop_assert_eq!(cpls.len(), 1),
            }
        }
    }

    #[test]
    fn refusals() {
        let t = Tag::new(700).unwrap();
        let rd = Tlp::mem_read(Bdf(5), t, 0x1004, 4, 0xe, 0x7);
        let ur = refuse(&rd, Bdf(9), CplStatus::UnsupportedRequest).unwrap();
        let Header::Completion(h) = ur.header else { panic!() };
        assert_eq!((ur.kind, ur.tag, h.requester_id, h.completer_id), (TlpKind::Cpl, t, Bdf(5), Bdf(9)));
        assert_eq!((h.status, h.byte_count, h.lower_address), (CplStatus::UnsupportedRequest, 14, 5));
        let cfg = Tlp::cfg_read(true, Bdf(5), t, Bdf(0x100), 0, 0xf);
        let Header::Completion(h) = refuse(&cfg, Bdf(9), CplStatus::UnsupportedRequest).unwrap().header
        else {
            panic!()
        };
        assert_eq!((h.byte_count, h.lower_address), (4, 0));
        assert_eq!(
            refuse(&Tlp::mem_write(Bdf(5), 0, 0xf, 0, vec![0; 4]), Bdf(9), CplStatus::UnsupportedRequest),
            None
        );
        // An AtomicOp FetchAdd (not modelled) still gets its UR; a message gets nothing.
        let mut fetch_add = [0u8; 16];
        fetch_add[0] = 0x4c;
        fetch_add[3] = 1;
        fetch_add[4..7].copy_from_slice(&[0x01, 0x00, 0x2a]);
        let p = lanbus_wire::tlp::Packet::new_checked(&fetch_add[..]).unwrap();
        let c = refuse_packet(&p, Bdf(9), CplStatus::UnsupportedRequest).unwrap();
        assert_eq!((c.requester_id(), c.tag), (Bdf(0x100), Tag::new(0x2a).unwrap()));
        let msg = [0x30u8, 0, 0, 0, 0, 0, 0, 0x7f, 0, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(
            refuse_packet(
                &lanbus_wire::tlp::Packet::new_checked(&msg[..]).unwrap(),
                Bdf(9),
                CplStatus::UnsupportedRequest
            ),
            None
        );
    }

    #[test]
    fn completions_from_memory() {
        let mem: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
        let rd = Tlp::mem_read(Bdf(0x100), Tag::new(5).unwrap(), 0x1004, 100, 0xe, 0x3);
        let cpls = completions_for_read(&rd, Bdf(0x200), 128, 64, |a, buf| {
            buf.copy_from_slice(&mem[a as usize..a as usize + buf.len()]);
            Ok(())
        })
        .unwrap();
        let (_, len) =
            RequestShape { address: 0x1004, length_dw: 100, first_be: 0xe, last_be: 0x3 }.byte_range();
        let mut r = crate::ReadReassembly::new(Bdf(0x100), Tag::new(5).unwrap(), 0x1005, len).unwrap();
        for c in &cpls {
            assert!(c.data.len() <= 128);
            let _ = r.handle_completion(c).unwrap();
        }
        assert!(r.is_complete());
        assert_eq!(r.into_data().unwrap(), &mem[0x1005..0x1005 + len]);
        let abort = completions_for_read(&rd, Bdf(0x200), 128, 64, |_, _| Err(())).unwrap();
        assert_eq!(abort.len(), 1);
        assert_eq!(abort[0].kind, TlpKind::Cpl);
    }
}

#[cfg(test)]
mod each_completion_tests {
    use super::*;
    use crate::Tag;

    #[test]
    fn each_completion_for_read_emits_exactly_completions_for_read() {
        let mem: Vec<u8> = (0..16384u32).map(|i| (i * 13 + 5) as u8).collect();
        let mut scratch = CompletionScratch::default();
        let requester = Bdf::new(2, 0, 0).unwrap();
        for (address, len) in
            [(0x0u64, 4096usize), (0x3, 1), (0x7d, 600), (0x1ffc, 4), (0x100, 0), (0x2f0, 4096)]
        {
            for (mps, rcb) in [(128, 64), (256, 64), (512, 128), (4096, 128)] {
                for fail_at in [None, Some(0x1000u64)] {
                    let Ok(reqs) = read_requests(requester, address, len, 4096, || Ok(Tag::new(7).unwrap()))
                    else {
                        continue;
                    };
                    for (_, req) in reqs {
                        let read = |a: u64, buf: &mut [u8]| {
                            if fail_at.is_some_and(|f| a >= f) {
                                return Err(());
                            }
                            let a = a as usize;
                            buf.copy_from_slice(&mem[a..a + buf.len()]);
                            Ok(())
                        };
                        let want = completions_for_read(&req, Bdf(0), mps, rcb, read);
                        let mut got = Vec::new();
                        let r = each_completion_for_read(
                            &req,
                            Bdf(0),
                            mps,
                            rcb,
                            &mut scratch,
                            read,
                            |c, payload| {
                                let mut whole = c.clone();
                                whole.data = payload.to_vec();
                                got.push(whole)
                            },
                        );
                        match want {
                            Ok(want) => {
                                assert!(r.is_ok());
                                assert_eq!(
                                    got, want,
                                    "{address:#x} {len} mps {mps} rcb {rcb} fail {fail_at:?}"
                                );
                            }
                            Err(_) => assert!(r.is_err() && got.is_empty()),
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn completion_headers_with_their_payloads_are_exactly_completions_for_read() {
        let mem: Vec<u8> = (0..16384u32).map(|i| (i * 7 + 1) as u8).collect();
        let requester = Bdf::new(2, 0, 0).unwrap();
        for (address, len) in [(0x0u64, 4096usize), (0x3, 1), (0x7d, 600), (0x1ffc, 4), (0x2f0, 4096)] {
            for (mps, rcb) in [(128, 64), (256, 64), (512, 128), (4096, 128)] {
                let reqs = read_requests(requester, address, len, 4096, || Ok(Tag::new(7).unwrap())).unwrap();
                for (_, req) in reqs {
                    let read = |a: u64, buf: &mut [u8]| {
                        let a = a as usize;
                        buf.copy_from_slice(&mem[a..a + buf.len()]);
                        Ok(())
                    };
                    let want = completions_for_read(&req, Bdf(0), mps, rcb, read).unwrap();
                    let got: Vec<Tlp> = read_completion_headers(&req, Bdf(0), mps, rcb)
                        .unwrap()
                        .into_iter()
                        .map(|(mut c, at, n)| {
                            c.data = mem[at as usize..at as usize + n].to_vec();
                            c
                        })
                        .collect();
                    assert_eq!(got, want, "{address:#x} {len} mps {mps} rcb {rcb}");
                }
            }
        }
        // A zero-length read is left to completions_for_read.
        let (_, req) =
            read_requests(requester, 0x100, 0, 4096, || Ok(Tag::new(7).unwrap())).unwrap().remove(0);
        assert!(read_completion_headers(&req, Bdf(0), 256, 64).unwrap().is_empty());
    }
}
