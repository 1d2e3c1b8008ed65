//! Physical Region Page entries and lists (NVMe base specification 1.4 section 4.3, "Physical
//! Region Page Entry and List"; 2.0: 4.1.1).
//!
//! Device side: [`walk`] turns PRP1/PRP2 of a command into the runs of host memory its data
//! occupies, reading PRP lists (chained when a transfer needs more entries than fit in one memory
//! page) through [`HostMemory`], one DMA read per list page, and merging physically adjacent
//! pages into one run so the data moves in as few DMA transfers as possible. Rules enforced:
//! PRP1 may have a dword-aligned offset; every later data entry has offset 0; PRP2 as a list
//! pointer and chain pointers are dword aligned; a violation is "PRP Offset Invalid".
//!
//! Host side: [`build`] produces PRP1, PRP2 and the contents of the list pages for a buffer that is
//! contiguous in bus address space.

use crate::status::Status;
use crate::HostMemory;

/// One run of host memory: bus address and length in bytes.
pub type Run = (u64, usize);

/// Appends a run, merged into the last one when it continues it.
pub(crate) fn push_run(runs: &mut Vec<Run>, addr: u64, len: usize) {
    if let Some(last) = runs.last_mut() {
        if last.0.wrapping_add(last.1 as u64) == addr {
            last.1 += len;
            return;
        }
    }
    runs.push((addr, len));
}

/// Resolves the data pointer of a `len`-byte transfer with memory page size `page` (a power of
/// two, at least 4096) into `runs` (cleared first). `scratch` is reused for list reads.
pub fn walk(
    mem: &mut dyn HostMemory,
    prp1: u64,
    prp2: u64,
    len: usize,
    page: usize,
    runs: &mut Vec<Run>,
    scratch: &mut Vec<u8>,
) -> Result<(), Status> {
    runs.clear();
    if len == 0 {
        return Ok(());
    }
    let mask = page as u64 - 1;
    if prp1 & 3 != 0 {
        return Err(Status::PRP_OFFSET_INVALID);
    }
    let first = len.min(page - (prp1 & mask) as usize);
    push_run(runs, prp1, first);
    let mut remaining = len - first;
    if remaining == 0 {
        return Ok(());
    }
    if remaining <= page {
        if prp2 & mask != 0 {
            return Err(Status::PRP_OFFSET_INVALID);
        }
        push_run(runs, prp2, remaining);
        return Ok(());
    }
    let mut list = prp2;
    let mut needed = remaining.div_ceil(page);
    // Each list page yields at least one entry, so this bounds a hostile circular chain.
    let mut hops = needed + 1;
    while needed > 0 {
        if list & 3 != 0 {
            return Err(Status::PRP_OFFSET_INVALID);
        }
        hops -= 1;
        if hops == 0 {
            return Err(Status::INVALID_FIELD);
        }
        let slots = (page - (list & mask) as usize) / 8;
        let (take, chained) = if needed <= slots { (needed, false) } else { (slots, true) };
        scratch.resize(take * 8, 0);
        mem.read(list, &mut scratch[..take * 8]).map_err(|_| Status::DATA_TRANSFER_ERROR)?;
        let data_entries = if chained { take - 1 } else { take };
        for i in 0..data_entries {
            let e = u64::from_le_bytes(scratch[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
            if e & mask != 0 {
                return Err(Status::PRP_OFFSET_INVALID);
            }
            let n = remaining.min(page);
            push_run(runs, e, n);
            remaining -= n;
        }
        needed -= data_entries;
        if chained {
            let at = (take - 1) * 8;
            list = u64::from_le_bytes(scratch[at..at + 8].try_into().unwrap_or([0; 8]));
        }
    }
    Ok(())
}

/// Number of PRP list pages [`build`] needs for a `len`-byte buffer at bus address `addr`.
pub fn list_pages_needed(addr: u64, len: usize, page: usize) -> usize {
    let first = len.min(page - (addr as usize & (page - 1)));
    let rest = (len - first).div_ceil(page);
    if rest <= 1 {
        return 0;
    }
    let per = page / 8;
    if rest <= per {
        1
    } else {
        1 + (rest - per).div_ceil(per - 1)
    }
}

/// PRP1 and PRP2 of a command, and the list pages to write before submitting it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrpPlan {
    /// PRP entry 1.
    pub prp1: u64,
    /// PRP entry 2 (0 when unused).
    pub prp2: u64,
    /// (bus address of a list page, its entries as little-endian bytes).
    pub lists: Vec<(u64, Vec<u8>)>,
}

/// Builds the PRPs for a `len`-byte buffer contiguous at bus address `addr` (dword aligned),
/// putting lists in `list_pages` (exactly [`list_pages_needed`] page-aligned pages).
pub fn build(addr: u64, len: usize, page: usize, list_pages: &[u64]) -> PrpPlan {
    let mask = page as u64 - 1;
    let first = len.min(page - (addr & mask) as usize);
    let rest = (len - first).div_ceil(page);
    let second = (addr & !mask) + page as u64;
    match rest {
        0 => PrpPlan { prp1: addr, prp2: 0, lists: Vec::new() },
        1 => PrpPlan { prp1: addr, prp2: second, lists: Vec::new() },
        _ => {
            let per = page / 8;
            let mut lists = Vec::with_capacity(list_pages.len());
            let mut next = 0usize;
            for (i, &lp) in list_pages.iter().enumerate() {
                let left = rest - next;
                let last = i + 1 == list_pages.len();
                let n = if last { left.min(per) } else { per - 1 };
                let mut bytes = Vec::with_capacity((n + usize::from(!last)) * 8);
                for k in 0..n {
                    bytes.extend_from_slice(&(second + ((next + k) * page) as u64).to_le_bytes());
                }
                next += n;
                if !last {
                    bytes.extend_from_slice(&list_pages[i + 1].to_le_bytes());
                }
                lists.push((lp, bytes));
            }
            PrpPlan { prp1: addr, prp2: list_pages.first().copied().unwrap_or(0), lists }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanbus_bridge::dma::BusError;
    use std::collections::HashMap;

    /// Sparse host memory in 4 KiB pages.
    struct Mem(HashMap<u64, Vec<u8>>);
    impl Mem {
        fn put(&mut self, addr: u64, bytes: &[u8]) {
            for (i, b) in bytes.iter().enumerate() {
                let a = addr + i as u64;
                self.0.entry(a & !4095).or_insert_with(|| vec![0; 4096])[(a & 4095) as usize] = *b;
            }
        }
    }
    impl HostMemory for Mem {
        fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
            for (i, b) in buf.iter_mut().enumerate() {
                let a = addr + i as u64;
                let p = self.0.get(&(a & !4095)).ok_or(BusError::Unsupported { addr: a })?;
                *b = p[(a & 4095) as usize];
            }
            Ok(())
        }
        fn write(&mut self, _: u64, _: &[u8]) -> Result<(), BusError> {
            Ok(())
        }
    }

    fn roundtrip(addr: u64, len: usize, page: usize) {
        let n = list_pages_needed(addr, len, page);
        let lps: Vec<u64> = (0..n as u64).map(|i| 0x1000_0000 + i * 3 * page as u64).collect();
        let plan = build(addr, len, page, &lps);
        assert_eq!(plan.lists.len(), n);
        let mut mem = Mem(HashMap::new());
        for (a, bytes) in &plan.lists {
            assert!(bytes.len() <= page);
            mem.put(*a, bytes);
        }
        let mut runs = Vec::new();
        walk(&mut mem, plan.prp1, plan.prp2, len, page, &mut runs, &mut Vec::new()).unwrap();
        assert_eq!(runs, vec![(addr, len)], "addr {addr:#x} len {len}");
    }

    #[test]
    fn build_then_walk() {
        for &addr in &[0x10_0000u64, 0x10_0004, 0x10_0ffc, 0x10_0800] {
            for &len in
                &[4usize, 512, 4096, 4100, 8192, 8196, 12288, 65536, 2 << 20, (2 << 20) + 4096, 5 << 20]
            {
                roundtrip(addr, len, 4096);
            }
        }
        // A 16 KiB memory page (CC.MPS = 2): lists hold 2048 entries.
        for &addr in &[0x10_0000u64, 0x10_0004, 0x10_3ffc] {
            for &len in &[4usize, 16384, 16388, 32768, 49152, 32 << 20, (32 << 20) + 16384 * 3] {
                roundtrip(addr, len, 16384);
            }
        }
    }

    #[test]
    fn scattered_pages_give_separate_runs() {
        let mut mem = Mem(HashMap::new());
        let entries: Vec<u8> = [0x7000u64, 0x3000, 0x4000].iter().flat_map(|e| e.to_le_bytes()).collect();
        mem.put(0x9008, &entries);
        let mut runs = Vec::new();
        walk(&mut mem, 0x1800, 0x9008, 2048 + 3 * 4096 - 100, 4096, &mut runs, &mut Vec::new()).unwrap();
        assert_eq!(runs, vec![(0x1800, 2048), (0x7000, 4096), (0x3000, 8192 - 100)]);
    }

    #[test]
    fn offsets_checked() {
        let mut mem = Mem(HashMap::new());
        let mut runs = Vec::new();
        let e = walk(&mut mem, 0x1002, 0, 16, 4096, &mut runs, &mut Vec::new());
        assert_eq!(e, Err(Status::PRP_OFFSET_INVALID));
        let e = walk(&mut mem, 0x1000, 0x2200, 8192, 4096, &mut runs, &mut Vec::new());
        assert_eq!(e, Err(Status::PRP_OFFSET_INVALID));
        // A list entry with an offset.
        mem.put(0x9000, &0x5000u64.to_le_bytes());
        mem.put(0x9008, &0x6010u64.to_le_bytes());
        let e = walk(&mut mem, 0x1000, 0x9000, 3 * 4096, 4096, &mut runs, &mut Vec::new());
        assert_eq!(e, Err(Status::PRP_OFFSET_INVALID));
        // A list the host did not map.
        let e = walk(&mut mem, 0x1000, 0xA000, 3 * 4096, 4096, &mut runs, &mut Vec::new());
        assert_eq!(e, Err(Status::DATA_TRANSFER_ERROR));
    }

    #[test]
    fn circular_chain_terminates() {
        let mut mem = Mem(HashMap::new());
        let mut p = vec![0u8; 4096];
        p[4088..].copy_from_slice(&0x9FF8u64.to_le_bytes());
        mem.0.insert(0x9000, p);
        let mut runs = Vec::new();
        let e = walk(&mut mem, 0x1000, 0x9FF8, 64 * 4096, 4096, &mut runs, &mut Vec::new());
        assert_eq!(e, Err(Status::INVALID_FIELD));
    }
}
