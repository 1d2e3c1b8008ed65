//! Block I/O (host side of the driver): reads and writes by block and by byte, Flush, Write
//! Zeroes and Dataset Management (deallocate), as a second `impl NvmeDriver` block. These are the
//! NVM commands of NVMe base specification 1.4 section 6; a transfer is split at MDTS into
//! commands that are in flight together, in windows of
//! [`DriverConfig::max_inflight_bytes`](super::DriverConfig::max_inflight_bytes), each with its
//! PRPs (section 4.3) over buffers of its own. A write whose data goes into the Controller
//! Memory Buffer is split finer
//! ([`DriverConfig::pipelined_write_bytes`](super::DriverConfig::pipelined_write_bytes)), each
//! command submitted as soon as its own data is posted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::memory::DmaBuf;
use super::{DriverError, NvmeDriver, Pending, Result};
use crate::command::{nvm_opcode, Sqe};
use crate::{prp, sgl};

impl NvmeDriver {
    fn check_blocks(&self, lba: u64, blocks: u64) -> Result<()> {
        match lba.checked_add(blocks) {
            Some(end) if end <= self.identity.blocks => Ok(()),
            _ => Err(DriverError::InvalidArgument(format!(
                "blocks {lba}..+{blocks} beyond the namespace's {} blocks",
                self.identity.blocks
            ))),
        }
    }

    /// A read or write command for `len` bytes at `lba` with a fresh DMA buffer (for a write,
    /// `data` is copied into it just before the command is submitted).
    fn rw_command<'a>(
        &'a self,
        write: bool,
        lba: u64,
        len: usize,
        data: Option<&'a [u8]>,
        fua: bool,
    ) -> Result<Pending<'a>> {
        let mut p = self.rw_command_unfilled(write || data.is_some(), lba, len, fua)?;
        p.fill = data;
        Ok(p)
    }

    /// As [`NvmeDriver::rw_command`], without the write's data: the caller puts it into the
    /// command's buffer before submitting it.
    pub(super) fn rw_command_unfilled<'a>(
        &'a self,
        write: bool,
        lba: u64,
        len: usize,
        fua: bool,
    ) -> Result<Pending<'a>> {
        let cmb = self.cmb.as_ref();
        let buf = match write {
            true => DmaBuf::prefer_cmb(cmb.filter(|c| c.write_data), &*self.mem, len)?,
            false => DmaBuf::new(&*self.mem, len)?,
        };
        let n = prp::list_pages_needed(buf.addr, len, self.page);
        let blocks = (len / self.identity.lba_size as usize) as u32;
        let mut sqe = Sqe {
            opcode: if write { nvm_opcode::WRITE } else { nvm_opcode::READ },
            nsid: self.identity.nsid,
            cdw: [lba as u32, (lba >> 32) as u32, (blocks - 1) | u32::from(fua) << 30, 0, 0, 0],
            ..Sqe::default()
        };
        let mut lists = Vec::new();
        if n > 0 && self.cfg.use_sgl && self.identity.sgl {
            // One Data Block descriptor names the whole buffer: no list to write or to fetch.
            (sqe.prp1, sqe.prp2) = sgl::data_block(buf.addr, len as u32);
            sqe.psdt = 1;
        } else {
            for _ in 0..n {
                lists.push(DmaBuf::prefer_cmb(cmb.filter(|c| c.lists), &*self.mem, self.page)?);
            }
            let addrs: Vec<u64> = lists.iter().map(|l| l.addr).collect();
            let plan = prp::build(buf.addr, len, self.page, &addrs);
            for (addr, bytes) in &plan.lists {
                self.put(*addr, bytes)?;
            }
            (sqe.prp1, sqe.prp2) = (plan.prp1, plan.prp2);
        }
        Ok(Pending { sqe, data: Some(buf), lists, fill: None })
    }

    /// Bytes of one request in flight at once: whole commands, at least one.
    pub(super) fn window_bytes(&self) -> usize {
        let chunk = self.chunk_bytes();
        (self.cfg.max_inflight_bytes / chunk).max(1) * chunk
    }

    /// Command size of a write: [`NvmeDriver::pipelined_chunk_bytes`] when write data goes
    /// into the memory buffer, else as for a read.
    pub(super) fn write_chunk_bytes(&self) -> usize {
        match self.cmb.as_ref().is_some_and(|c| c.write_data) {
            true => self.pipelined_chunk_bytes(),
            false => self.chunk_bytes(),
        }
    }

    /// Command size of a write sent as its data arrives (into the memory buffer, or filled in
    /// place by [`IoStream::submit_write_filled`](super::IoStream::submit_write_filled)):
    /// [`DriverConfig::pipelined_write_bytes`](super::DriverConfig) in whole blocks, at most
    /// MDTS; 0 keeps MDTS.
    pub(super) fn pipelined_chunk_bytes(&self) -> usize {
        let chunk = self.chunk_bytes();
        let lba = self.identity.lba_size as usize;
        match self.cfg.pipelined_write_bytes {
            0 => chunk,
            n => (n / lba * lba).clamp(lba, chunk),
        }
    }

    pub(super) fn chunk_bytes(&self) -> usize {
        let lba = self.identity.lba_size as usize;
        self.identity.max_transfer_bytes.min(65536 * lba) / lba * lba
    }

    /// Reads `buf.len()` bytes (a multiple of the block size) starting at block `lba`.
    pub fn read(&self, lba: u64, buf: &mut [u8]) -> Result<()> {
        let start = Instant::now();
        let r = self.read_untimed(lba, buf);
        bump_ns(&self.stats.io_ns, start);
        r
    }

    fn read_untimed(&self, lba: u64, buf: &mut [u8]) -> Result<()> {
        let bs = self.identity.lba_size as usize;
        if !buf.len().is_multiple_of(bs) {
            return Err(DriverError::InvalidArgument(format!(
                "read length {} is not a multiple of {bs}",
                buf.len()
            )));
        }
        self.check_blocks(lba, (buf.len() / bs) as u64)?;
        let chunk = self.chunk_bytes();
        let window = self.window_bytes();
        for (w, group) in buf.chunks_mut(window).enumerate() {
            let lba = lba + (w * window / bs) as u64;
            let mut cmds = Vec::new();
            for (i, part) in group.chunks(chunk).enumerate() {
                cmds.push(self.rw_command(false, lba + (i * chunk / bs) as u64, part.len(), None, false)?);
            }
            self.run_io(&mut cmds)?;
            let copy = Instant::now();
            for (part, cmd) in group.chunks_mut(chunk).zip(&cmds) {
                if let Some(d) = &cmd.data {
                    self.mem.read(d.addr, part)?;
                    // Relaxed: a statistic.
                    self.stats.copy_bytes.fetch_add(part.len() as u64, Ordering::Relaxed);
                }
            }
            bump_ns(&self.stats.copy_ns, copy);
        }
        Ok(())
    }

    /// Reads `len` bytes at byte `offset` and lends them to `reply` where they lie in DMA memory
    /// (no copy out), for a read of whole blocks that fits one window of commands in flight;
    /// `None` for any other (use [`NvmeDriver::read_at`]). `reply` is called only when every
    /// command succeeded. The time `reply` takes is not counted as the driver's.
    pub fn read_lent(&self, offset: u64, len: usize, reply: &mut dyn FnMut(&[&[u8]])) -> Option<Result<()>> {
        let bs = self.identity.lba_size as usize;
        if len == 0
            || !offset.is_multiple_of(bs as u64)
            || !len.is_multiple_of(bs)
            || len > self.window_bytes()
        {
            return None;
        }
        let start = Instant::now();
        let mut lent_ns = 0;
        let r = (|| {
            self.byte_range(offset, len)?;
            let lba = offset / bs as u64;
            self.check_blocks(lba, (len / bs) as u64)?;
            let chunk = self.chunk_bytes();
            let mut cmds = Vec::new();
            for at in (0..len).step_by(chunk) {
                cmds.push(self.rw_command(
                    false,
                    lba + (at / bs) as u64,
                    chunk.min(len - at),
                    None,
                    false,
                )?);
            }
            self.run_io(&mut cmds)?;
            let runs: Vec<(u64, usize)> = cmds
                .iter()
                .zip((0..len).step_by(chunk))
                .filter_map(|(cmd, at)| cmd.data.as_ref().map(|d| (d.addr, chunk.min(len - at))))
                .collect();
            let lending = Instant::now();
            self.mem.lend(&runs, reply)?;
            lent_ns = lending.elapsed().as_nanos() as u64;
            Ok(())
        })();
        let ns = (start.elapsed().as_nanos() as u64).saturating_sub(lent_ns);
        // Relaxed: a statistic, read as a snapshot.
        self.stats.io_ns.fetch_add(ns, Ordering::Relaxed);
        Some(r)
    }

    /// Writes `data` (a multiple of the block size) starting at block `lba`; with `fua` the data
    /// is durable when this returns.
    pub fn write(&self, lba: u64, data: &[u8], fua: bool) -> Result<()> {
        let start = Instant::now();
        let r = self.write_untimed(lba, data, fua);
        bump_ns(&self.stats.io_ns, start);
        r
    }

    fn write_untimed(&self, lba: u64, data: &[u8], fua: bool) -> Result<()> {
        let bs = self.identity.lba_size as usize;
        if !data.len().is_multiple_of(bs) {
            return Err(DriverError::InvalidArgument(format!(
                "write length {} is not a multiple of {bs}",
                data.len()
            )));
        }
        self.check_blocks(lba, (data.len() / bs) as u64)?;
        let chunk = self.write_chunk_bytes();
        let window = self.window_bytes();
        for (w, group) in data.chunks(window).enumerate() {
            let lba = lba + (w * window / bs) as u64;
            let mut cmds = Vec::new();
            for (i, part) in group.chunks(chunk).enumerate() {
                cmds.push(self.rw_command(
                    true,
                    lba + (i * chunk / bs) as u64,
                    part.len(),
                    Some(part),
                    fua,
                )?);
            }
            self.run_io(&mut cmds)?;
        }
        Ok(())
    }

    /// Flush: everything written so far is durable.
    pub fn flush(&self) -> Result<()> {
        let sqe = Sqe { opcode: nvm_opcode::FLUSH, nsid: self.identity.nsid, ..Sqe::default() };
        self.run_io(&mut [Pending { sqe, data: None, lists: Vec::new(), fill: None }])?;
        Ok(())
    }

    /// Write Zeroes over `blocks` blocks at `lba` (split in commands of 65536 blocks); with
    /// `deallocate` the controller may deallocate them (they read back as zeroes either way).
    pub fn write_zeroes(&self, lba: u64, blocks: u64, deallocate: bool) -> Result<()> {
        self.check_blocks(lba, blocks)?;
        let mut cmds = Vec::new();
        let mut at = 0;
        while at < blocks {
            let n = (blocks - at).min(65536);
            let l = lba + at;
            let sqe = Sqe {
                opcode: nvm_opcode::WRITE_ZEROES,
                nsid: self.identity.nsid,
                cdw: [l as u32, (l >> 32) as u32, (n as u32 - 1) | u32::from(deallocate) << 25, 0, 0, 0],
                ..Sqe::default()
            };
            cmds.push(Pending { sqe, data: None, lists: Vec::new(), fill: None });
            at += n;
        }
        self.run_io(&mut cmds)?;
        Ok(())
    }

    /// Dataset Management with the Deallocate attribute over `blocks` blocks at `lba`: they read
    /// back as zeroes afterwards.
    pub fn deallocate(&self, lba: u64, blocks: u64) -> Result<()> {
        self.check_blocks(lba, blocks)?;
        let mut ranges = Vec::new();
        let mut at = 0;
        while at < blocks {
            let n = (blocks - at).min(u64::from(u32::MAX));
            ranges.push((lba + at, n as u32));
            at += n;
        }
        let mut cmds = Vec::new();
        for group in ranges.chunks(256) {
            let buf = DmaBuf::new(&*self.mem, 4096)?;
            let mut bytes = Vec::with_capacity(group.len() * 16);
            for &(slba, n) in group {
                bytes.extend_from_slice(&0u32.to_le_bytes());
                bytes.extend_from_slice(&n.to_le_bytes());
                bytes.extend_from_slice(&slba.to_le_bytes());
            }
            self.mem.write(buf.addr, &bytes)?;
            let sqe = Sqe {
                opcode: nvm_opcode::DATASET_MANAGEMENT,
                nsid: self.identity.nsid,
                prp1: buf.addr,
                cdw: [group.len() as u32 - 1, 1 << 2, 0, 0, 0, 0],
                ..Sqe::default()
            };
            cmds.push(Pending { sqe, data: Some(buf), lists: Vec::new(), fill: None });
        }
        if !cmds.is_empty() {
            self.run_io(&mut cmds)?;
        }
        Ok(())
    }

    pub(super) fn byte_range(&self, offset: u64, len: usize) -> Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.size_bytes() => Ok(()),
            _ => Err(DriverError::InvalidArgument(format!(
                "bytes {offset}..+{len} beyond the namespace's {} bytes",
                self.size_bytes()
            ))),
        }
    }

    /// Reads `buf.len()` bytes at byte `offset` (any alignment; split into blocks and
    /// MDTS-sized commands in flight together).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.byte_range(offset, buf.len())?;
        let bs = u64::from(self.identity.lba_size);
        if offset.is_multiple_of(bs) && (buf.len() as u64).is_multiple_of(bs) {
            return self.read(offset / bs, buf);
        }
        let first = offset / bs;
        let end = (offset + buf.len() as u64).div_ceil(bs);
        let mut tmp = vec![0u8; ((end - first) * bs) as usize];
        self.read(first, &mut tmp)?;
        let skip = (offset - first * bs) as usize;
        buf.copy_from_slice(&tmp[skip..skip + buf.len()]);
        Ok(())
    }

    /// Writes `data` at byte `offset`. Partial blocks at either end are read, merged and written
    /// back (not atomic against a concurrent write to the same block).
    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.byte_range(offset, data.len())?;
        let bs = u64::from(self.identity.lba_size);
        if offset.is_multiple_of(bs) && (data.len() as u64).is_multiple_of(bs) {
            return self.write(offset / bs, data, fua);
        }
        let first = offset / bs;
        let end = (offset + data.len() as u64).div_ceil(bs);
        let mut tmp = vec![0u8; ((end - first) * bs) as usize];
        let bsz = bs as usize;
        self.read(first, &mut tmp[..bsz])?;
        if end - first > 1 {
            let last = tmp.len() - bsz;
            self.read(end - 1, &mut tmp[last..])?;
        }
        let skip = (offset - first * bs) as usize;
        tmp[skip..skip + data.len()].copy_from_slice(data);
        self.write(first, &tmp, fua)
    }

    /// Zeroes `len` bytes at byte `offset`: whole blocks with Write Zeroes (deallocating them if
    /// `may_trim`), partial ones by read-modify-write.
    pub fn write_zeroes_at(&self, offset: u64, len: u64, may_trim: bool) -> Result<()> {
        self.byte_range(offset, usize::try_from(len).unwrap_or(usize::MAX))?;
        let bs = u64::from(self.identity.lba_size);
        let end = offset + len;
        let a = offset.div_ceil(bs) * bs;
        let b = (end / bs) * bs;
        if a >= b {
            return self.write_at(offset, &vec![0u8; len as usize], false);
        }
        if offset < a {
            self.write_at(offset, &vec![0u8; (a - offset) as usize], false)?;
        }
        self.write_zeroes(a / bs, (b - a) / bs, may_trim)?;
        if b < end {
            self.write_at(b, &vec![0u8; (end - b) as usize], false)?;
        }
        Ok(())
    }

    /// Deallocates the whole blocks inside `len` bytes at `offset` (a hint: partial blocks at the
    /// ends are left as they are).
    pub fn trim_at(&self, offset: u64, len: u64) -> Result<()> {
        self.byte_range(offset, usize::try_from(len).unwrap_or(usize::MAX))?;
        let bs = u64::from(self.identity.lba_size);
        let a = offset.div_ceil(bs);
        let b = (offset + len) / bs;
        if a < b {
            self.deallocate(a, b - a)?;
        }
        Ok(())
    }
}

/// Adds the time since `start` to a nanosecond counter.
fn bump_ns(counter: &AtomicU64, start: Instant) {
    // Relaxed: a statistic, read as a snapshot.
    counter.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
}
