//! Scatter Gather Lists (NVMe base specification 1.4 section 4.4, "Scatter Gather List (SGL)";
//! 2.0: 4.1.2), for the data of I/O commands with PSDT 01b.
//!
//! Device side: [`walk`] turns the command's first descriptor (SGL1, the 16 bytes of the data
//! pointer) into the runs of host memory its data occupies, reading SGL segments through
//! [`HostMemory`], one DMA read per segment, and merging adjacent blocks into one run. What this
//! controller takes: Data Block descriptors (address sub type), and Segment and Last Segment
//! descriptors chaining segments, as its Identify Controller data says (SGLS bits 1:0 = 01b: no
//! alignment or granularity requirement). A Segment or Last Segment descriptor may only end a
//! Segment; a Last Segment holds data descriptors only; the blocks' lengths must add up to the
//! transfer exactly. Violations complete the command with the status the specification gives.
//!
//! Host side: [`data_block`] is the one descriptor that names a buffer contiguous in bus
//! address space, which needs no segment at all where PRPs need a list beyond two pages.

use crate::prp::{push_run, Run};
use crate::status::Status;
use crate::HostMemory;

/// Bytes of one descriptor.
pub const DESCRIPTOR_LEN: usize = 16;

/// Descriptor types (SGL Identifier bits 7:4).
mod kind {
    pub const DATA_BLOCK: u8 = 0x0;
    pub const SEGMENT: u8 = 0x2;
    pub const LAST_SEGMENT: u8 = 0x3;
}

/// The largest segment read: 4096 descriptors, sixteen times what a 1 MiB transfer of 4 KiB
/// pages needs. A longer one is refused (Invalid Number of SGL Descriptors) instead of read.
pub const MAX_SEGMENT_BYTES: usize = 64 << 10;

/// Descriptors read for one command at most, across its segments: bounds a hostile chain of
/// segments that carry no data.
pub const MAX_DESCRIPTORS: usize = 16 << 10;

/// One decoded descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Descriptor {
    addr: u64,
    len: u32,
    kind: u8,
    sub: u8,
}

impl Descriptor {
    fn parse(b: &[u8]) -> Descriptor {
        let addr = u64::from_le_bytes(b[0..8].try_into().unwrap_or([0; 8]));
        let len = u32::from_le_bytes(b[8..12].try_into().unwrap_or([0; 4]));
        Descriptor { addr, len, kind: b[15] >> 4, sub: b[15] & 0xF }
    }
}

/// The 16 bytes of SGL1 from a command's data pointer fields (PRP1 holds bytes 7:0, PRP2
/// bytes 15:8).
pub fn sgl1(prp1: u64, prp2: u64) -> [u8; DESCRIPTOR_LEN] {
    let mut b = [0u8; DESCRIPTOR_LEN];
    b[..8].copy_from_slice(&prp1.to_le_bytes());
    b[8..].copy_from_slice(&prp2.to_le_bytes());
    b
}

/// A Data Block descriptor for `len` bytes at bus address `addr`, as the data pointer fields
/// (PRP1, PRP2) of a command with PSDT 01b.
pub fn data_block(addr: u64, len: u32) -> (u64, u64) {
    // Bytes 11:8 the length, 14:12 reserved, 15 the identifier (Data Block, address: 0).
    (addr, u64::from(len))
}

/// Resolves SGL1 of a `len`-byte transfer into `runs` (cleared first). `scratch` is reused for
/// segment reads.
pub fn walk(
    mem: &mut dyn HostMemory,
    first: [u8; DESCRIPTOR_LEN],
    len: usize,
    runs: &mut Vec<Run>,
    scratch: &mut Vec<u8>,
) -> Result<(), Status> {
    runs.clear();
    let mut total = 0usize;
    let mut take = |d: Descriptor, runs: &mut Vec<Run>| -> Result<(), Status> {
        if d.sub != 0 {
            return Err(Status::SGL_DESCRIPTOR_TYPE_INVALID);
        }
        let n = d.len as usize;
        total = total.checked_add(n).filter(|&t| t <= len).ok_or(Status::DATA_SGL_LENGTH_INVALID)?;
        if n > 0 {
            push_run(runs, d.addr, n);
        }
        Ok(())
    };
    let mut next = Descriptor::parse(&first);
    let mut read = 0usize;
    loop {
        match next.kind {
            kind::DATA_BLOCK => {
                take(next, runs)?;
                break;
            }
            kind::SEGMENT | kind::LAST_SEGMENT => {
                if next.sub != 0 {
                    return Err(Status::SGL_DESCRIPTOR_TYPE_INVALID);
                }
                let bytes = next.len as usize;
                if bytes == 0 || !bytes.is_multiple_of(DESCRIPTOR_LEN) {
                    return Err(Status::INVALID_SGL_SEGMENT_DESCRIPTOR);
                }
                read += bytes / DESCRIPTOR_LEN;
                if bytes > MAX_SEGMENT_BYTES || read > MAX_DESCRIPTORS {
                    return Err(Status::INVALID_SGL_DESCRIPTOR_COUNT);
                }
                scratch.resize(bytes, 0);
                mem.read(next.addr, &mut scratch[..bytes]).map_err(|_| Status::DATA_TRANSFER_ERROR)?;
                let last = next.kind == kind::LAST_SEGMENT;
                let count = bytes / DESCRIPTOR_LEN;
                let mut chained = None;
                for (i, raw) in scratch[..bytes].chunks_exact(DESCRIPTOR_LEN).enumerate() {
                    let d = Descriptor::parse(raw);
                    match d.kind {
                        kind::DATA_BLOCK => take(d, runs)?,
                        // Only the last descriptor of a Segment may lead on.
                        kind::SEGMENT | kind::LAST_SEGMENT if !last && i + 1 == count => chained = Some(d),
                        kind::SEGMENT | kind::LAST_SEGMENT => {
                            return Err(Status::INVALID_SGL_SEGMENT_DESCRIPTOR)
                        }
                        _ => return Err(Status::SGL_DESCRIPTOR_TYPE_INVALID),
                    }
                }
                match chained {
                    Some(d) => next = d,
                    // A Segment must lead on to the next one.
                    None if !last => return Err(Status::INVALID_SGL_SEGMENT_DESCRIPTOR),
                    None => break,
                }
            }
            _ => return Err(Status::SGL_DESCRIPTOR_TYPE_INVALID),
        }
    }
    if total != len {
        return Err(Status::DATA_SGL_LENGTH_INVALID);
    }
    Ok(())
}

/// The fuzz target's body (`fuzz/fuzz_targets/nvme_sgl.rs`): the first 16 bytes are SGL1, the
/// next 4 the transfer length, the rest host memory at bus address 0x1000 (any segment read
/// elsewhere fails). Checks that a walk that succeeds covers exactly the transfer, inside what
/// the descriptors named. Panics only if that breaks.
#[cfg(any(test, fuzzing))]
pub fn fuzz_walk(data: &[u8]) {
    struct Flat<'a>(&'a [u8]);
    impl HostMemory for Flat<'_> {
        fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), crate::BusError> {
            let at = addr.checked_sub(0x1000).ok_or(crate::BusError::Unsupported { addr })? as usize;
            let src = self.0.get(at..at + buf.len()).ok_or(crate::BusError::Unsupported { addr })?;
            buf.copy_from_slice(src);
            Ok(())
        }
        fn write(&mut self, addr: u64, _: &[u8]) -> Result<(), crate::BusError> {
            Err(crate::BusError::Unsupported { addr })
        }
    }
    let (Some(first), Some(len)) = (data.get(..16), data.get(16..20)) else { return };
    let first: [u8; 16] = first.try_into().unwrap_or([0; 16]);
    let len = (u32::from_le_bytes(len.try_into().unwrap_or([0; 4])) & 0xF_FFFF) as usize;
    let mut runs = Vec::new();
    if walk(&mut Flat(&data[20..]), first, len, &mut runs, &mut Vec::new()).is_ok() {
        assert_eq!(runs.iter().map(|r| r.1).sum::<usize>(), len, "runs cover the transfer");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanbus_bridge::dma::BusError;
    use std::collections::HashMap;

    /// Sparse host memory, byte by byte.
    #[derive(Default)]
    struct Mem(HashMap<u64, u8>);
    impl Mem {
        fn put(&mut self, addr: u64, bytes: &[u8]) {
            for (i, b) in bytes.iter().enumerate() {
                self.0.insert(addr + i as u64, *b);
            }
        }
    }
    impl HostMemory for Mem {
        fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
            for (i, b) in buf.iter_mut().enumerate() {
                let a = addr + i as u64;
                *b = *self.0.get(&a).ok_or(BusError::Unsupported { addr: a })?;
            }
            Ok(())
        }
        fn write(&mut self, _: u64, _: &[u8]) -> Result<(), BusError> {
            Ok(())
        }
    }

    fn desc(addr: u64, len: u32, kind: u8) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&addr.to_le_bytes());
        b[8..12].copy_from_slice(&len.to_le_bytes());
        b[15] = kind << 4;
        b
    }

    fn segment(descs: &[[u8; 16]]) -> Vec<u8> {
        descs.iter().flatten().copied().collect()
    }

    fn run(mem: &mut Mem, first: [u8; 16], len: usize) -> Result<Vec<Run>, Status> {
        let mut runs = Vec::new();
        walk(mem, first, len, &mut runs, &mut Vec::new()).map(|()| runs)
    }

    #[test]
    fn one_data_block_in_the_command() {
        let (p1, p2) = data_block(0x12_3404, 65536);
        assert_eq!(sgl1(p1, p2), desc(0x12_3404, 65536, kind::DATA_BLOCK));
        assert_eq!(run(&mut Mem::default(), sgl1(p1, p2), 65536), Ok(vec![(0x12_3404, 65536)]));
        // The block must cover the transfer exactly.
        assert_eq!(run(&mut Mem::default(), sgl1(p1, p2), 65537), Err(Status::DATA_SGL_LENGTH_INVALID));
        assert_eq!(run(&mut Mem::default(), sgl1(p1, p2), 4096), Err(Status::DATA_SGL_LENGTH_INVALID));
    }

    #[test]
    fn segments_chain_and_adjacent_blocks_merge() {
        let mut mem = Mem::default();
        // A Segment of two blocks leading to a Last Segment of three, one of them empty.
        mem.put(
            0x9000,
            &segment(&[
                desc(0x1_0000, 4096, kind::DATA_BLOCK),
                desc(0x1_1000, 100, kind::DATA_BLOCK),
                desc(0xA000, 48, kind::LAST_SEGMENT),
            ]),
        );
        mem.put(
            0xA000,
            &segment(&[
                desc(0x5_0000, 0, kind::DATA_BLOCK),
                desc(0x7_0000, 3996, kind::DATA_BLOCK),
                desc(0x3_0000, 8192, kind::DATA_BLOCK),
            ]),
        );
        let runs = run(&mut mem, desc(0x9000, 48, kind::SEGMENT), 4096 + 100 + 3996 + 8192);
        assert_eq!(runs, Ok(vec![(0x1_0000, 4196), (0x7_0000, 3996), (0x3_0000, 8192)]));
        // The same Last Segment named by the command itself.
        assert_eq!(
            run(&mut mem, desc(0xA000, 48, kind::LAST_SEGMENT), 3996 + 8192),
            Ok(vec![(0x7_0000, 3996), (0x3_0000, 8192)])
        );
    }

    #[test]
    fn malformed_lists_fail_with_the_status_the_specification_gives() {
        let mut mem = Mem::default();
        // A Last Segment that leads on.
        mem.put(0x9000, &segment(&[desc(0x1000, 512, kind::DATA_BLOCK), desc(0xA000, 16, kind::SEGMENT)]));
        let e = run(&mut mem, desc(0x9000, 32, kind::LAST_SEGMENT), 512);
        assert_eq!(e, Err(Status::INVALID_SGL_SEGMENT_DESCRIPTOR));
        // A Segment that does not lead on.
        let e = run(&mut mem, desc(0x9000, 16, kind::SEGMENT), 512);
        assert_eq!(e, Err(Status::INVALID_SGL_SEGMENT_DESCRIPTOR));
        // A segment descriptor before the last place of a Segment.
        mem.put(0xB000, &segment(&[desc(0xA000, 16, kind::SEGMENT), desc(0x1000, 512, kind::DATA_BLOCK)]));
        let e = run(&mut mem, desc(0xB000, 32, kind::SEGMENT), 512);
        assert_eq!(e, Err(Status::INVALID_SGL_SEGMENT_DESCRIPTOR));
        // Segment lengths that are not whole descriptors, or none.
        for bytes in [0u32, 8, 24] {
            let e = run(&mut mem, desc(0x9000, bytes, kind::LAST_SEGMENT), 512);
            assert_eq!(e, Err(Status::INVALID_SGL_SEGMENT_DESCRIPTOR), "{bytes} bytes");
        }
        // Types and sub types this controller does not take: Bit Bucket, Keyed, Offset.
        for id in [0x10u8, 0x40, 0x50, 0x01, 0x21] {
            let mut d = desc(0x1000, 512, 0);
            d[15] = id;
            assert_eq!(run(&mut mem, d, 512), Err(Status::SGL_DESCRIPTOR_TYPE_INVALID), "identifier {id:#x}");
        }
        // Blocks adding up to more than the transfer.
        mem.put(
            0xC000,
            &segment(&[desc(0x1000, 512, kind::DATA_BLOCK), desc(0x2000, 512, kind::DATA_BLOCK)]),
        );
        let e = run(&mut mem, desc(0xC000, 32, kind::LAST_SEGMENT), 600);
        assert_eq!(e, Err(Status::DATA_SGL_LENGTH_INVALID));
        // A segment the host did not map, and one too long to read.
        let e = run(&mut mem, desc(0xF000, 16, kind::LAST_SEGMENT), 512);
        assert_eq!(e, Err(Status::DATA_TRANSFER_ERROR));
        let e = run(&mut mem, desc(0x9000, MAX_SEGMENT_BYTES as u32 + 16, kind::LAST_SEGMENT), 512);
        assert_eq!(e, Err(Status::INVALID_SGL_DESCRIPTOR_COUNT));
    }

    #[test]
    fn a_circular_chain_of_empty_segments_ends() {
        let mut mem = Mem::default();
        mem.put(0x9000, &segment(&[desc(0x9000, 16, kind::SEGMENT)]));
        let e = run(&mut mem, desc(0x9000, 16, kind::SEGMENT), 512);
        assert_eq!(e, Err(Status::INVALID_SGL_DESCRIPTOR_COUNT));
    }

    #[test]
    fn fuzz_corpus_passes() {
        let mut seed = segment(&[desc(0x1000, 32, kind::LAST_SEGMENT)]);
        seed.extend_from_slice(&1024u32.to_le_bytes());
        seed.extend_from_slice(&segment(&[desc(0x8000, 512, 0), desc(0x9000, 512, 0)]));
        fuzz_walk(&seed);
        fuzz_walk(&[]);
        fuzz_walk(&[0xFF; 64]);
    }

    proptest::proptest! {
        #[test]
        fn random_lists_never_panic_and_success_covers_the_transfer(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512),
        ) {
            fuzz_walk(&bytes);
        }

        #[test]
        fn mutated_chains_never_panic(at in 0usize..84, value in proptest::num::u8::ANY) {
            let mut seed = segment(&[desc(0x1000, 48, kind::SEGMENT)]);
            seed.extend_from_slice(&2048u32.to_le_bytes());
            seed.extend_from_slice(&segment(&[
                desc(0x8000, 1024, 0),
                desc(0x9000, 512, 0),
                desc(0x1030, 16, kind::LAST_SEGMENT),
                desc(0xA000, 512, 0),
            ]));
            seed[at] = value;
            fuzz_walk(&seed);
        }
    }
}
