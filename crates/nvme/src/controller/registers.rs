//! Controller registers (device side): reads and writes of BAR0 (registers and doorbells) and of
//! the Controller Memory Buffer's BAR2 memory, as a second `impl Controller` block. NVMe base
//! specification 1.4 (2.0 section numbers in brackets where they moved):
//!
//! - 3.1 [3.1.3] the registers: aligned 4-byte accesses, aligned 8-byte ones for the 64-bit
//!   registers (CAP, ASQ, ACQ, CMBMSC); anything else is rejected and counted.
//! - 7.6.1 [3.5.1] CC.EN 0->1 (CSS, MPS and AQA validated; invalid values set CSTS.CFS), 7.3.2
//!   controller reset on CC.EN 1->0, CC.SHN shutdown (flush, then CSTS.SHST complete).
//! - 4.1 [3.3.1] doorbells: every value the host writes is checked against the queue (an invalid
//!   doorbell write is counted and ignored).
//! - 4.7 [8.2] CMBLOC, CMBSZ, CMBMSC and CMBSTS, and the buffer's memory itself.
//!
//! None of this does DMA: doorbells only make work pending for [`Controller::process`].

use lanbus_bridge::dma::BusError;

use super::{cc, cmb, csts, reg, Controller, Cq, Sq, DEFAULT_FEATURES, MSIX_TABLE_OFFSET};

impl Controller {
    /// CAP (1.4 section 3.1.1).
    pub fn cap(&self) -> u64 {
        u64::from(self.cfg.max_queue_entries - 1) & 0xFFFF
            | 1 << 16 // CQR: contiguous queues required
            | u64::from(self.cfg.timeout_500ms) << 24
            | 1 << 37 // CSS: NVM command set
            | u64::from(self.cfg.mps_max) << 52
            | if self.cfg.cmb_bytes > 0 { cmb::CAP_CMBS } else { 0 }
    }

    /// The bus address the Controller Memory Buffer answers at, when the host enabled it.
    pub(super) fn cmb_base(&self) -> Option<u64> {
        let on = self.cfg.cmb_bytes > 0 && self.cmbmsc & cmb::CMSE != 0 && self.cmbsts & cmb::CBAI == 0;
        on.then_some(self.cmbmsc & !0xFFF)
    }

    fn write_cmbmsc(&mut self, v: u64) {
        if self.cfg.cmb_bytes == 0 {
            return;
        }
        self.cmbmsc = v & !0xFFC;
        let cba = self.cmbmsc & !0xFFF;
        let valid = cba != 0 && cba.checked_add(self.cfg.cmb_bytes).is_some();
        self.cmbsts = if self.cmbmsc & cmb::CMSE != 0 && !valid { cmb::CBAI } else { 0 };
    }

    /// A memory read of the Controller Memory Buffer (BAR2) at `offset`.
    pub fn cmb_read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BusError> {
        let at = self.cmb_range(offset, buf.len())?;
        buf.copy_from_slice(&self.cmb[at..at + buf.len()]);
        Ok(())
    }

    /// A memory write of the Controller Memory Buffer (BAR2) at `offset`: the host placing
    /// submission queue entries, PRP lists or write data there. Never does DMA or work.
    pub fn cmb_write(&mut self, offset: u64, data: &[u8]) -> Result<(), BusError> {
        let at = self.cmb_range(offset, data.len())?;
        self.cmb[at..at + data.len()].copy_from_slice(data);
        self.stats.bytes_copied += data.len() as u64;
        Ok(())
    }

    fn cmb_range(&self, offset: u64, len: usize) -> Result<usize, BusError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.cmb.len() as u64 => Ok(offset as usize),
            _ => Err(BusError::Unsupported { addr: offset }),
        }
    }

    fn check_access(&mut self, offset: u64, len: usize) -> Result<(), BusError> {
        let ok = match len {
            4 => offset.is_multiple_of(4),
            8 => matches!(offset, reg::CAP | reg::ASQ | reg::ACQ | reg::CMBMSC),
            _ => false,
        };
        if offset >= MSIX_TABLE_OFFSET {
            return Err(BusError::Unsupported { addr: offset });
        }
        if !ok {
            self.stats.rejected_accesses += 1;
            return Err(BusError::Rejected("NVMe registers take aligned 4-byte (or 8-byte 64-bit) accesses"));
        }
        Ok(())
    }

    fn read_reg64(&self, offset: u64) -> u64 {
        match offset {
            reg::CAP => self.cap(),
            reg::ASQ => self.asq,
            reg::ACQ => self.acq,
            reg::CMBMSC => self.cmbmsc,
            _ => 0,
        }
    }

    fn read_reg32(&self, offset: u64) -> u32 {
        match offset {
            0x00 | 0x04 | 0x28 | 0x2C | 0x30 | 0x34 | 0x50 | 0x54 => {
                (self.read_reg64(offset & !7) >> ((offset & 4) * 8)) as u32
            }
            reg::VS => 0x0001_0400,
            reg::INTMS | reg::INTMC => self.intms,
            reg::CC => self.cc,
            reg::CSTS => self.csts,
            reg::AQA => self.aqa,
            reg::CMBLOC if self.cmbmsc & cmb::CRE != 0 => u32::from(cmb::BIR),
            reg::CMBSZ if self.cmbmsc & cmb::CRE != 0 => {
                cmb::SQS | cmb::LISTS | cmb::WDS | ((self.cfg.cmb_bytes / cmb::UNIT_BYTES) as u32) << 12
            }
            reg::CMBSTS => self.cmbsts,
            _ => 0,
        }
    }

    /// A memory read of BAR0 at `offset` (registers; doorbells read as zero).
    pub fn bar0_read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BusError> {
        self.check_access(offset, buf.len())?;
        if buf.len() == 8 {
            buf.copy_from_slice(&self.read_reg64(offset).to_le_bytes());
        } else {
            buf.copy_from_slice(&self.read_reg32(offset).to_le_bytes());
        }
        Ok(())
    }

    /// A memory write of BAR0 at `offset`: registers and doorbells. Never does DMA; doorbells
    /// only make work pending for [`Controller::process`].
    pub fn bar0_write(&mut self, offset: u64, data: &[u8]) -> Result<(), BusError> {
        self.check_access(offset, data.len())?;
        if data.len() == 8 {
            let v = u64::from_le_bytes(data.try_into().unwrap_or([0; 8]));
            if offset == reg::CMBMSC {
                self.write_cmbmsc(v);
                return Ok(());
            }
            self.write_reg32(offset, v as u32);
            self.write_reg32(offset + 4, (v >> 32) as u32);
        } else {
            let v = u32::from_le_bytes(data.try_into().unwrap_or([0; 4]));
            self.write_reg32(offset, v);
        }
        Ok(())
    }

    fn write_reg32(&mut self, offset: u64, v: u32) {
        let set_half = |r: &mut u64, hi: bool, v: u32| {
            if hi {
                *r = (*r & 0xFFFF_FFFF) | u64::from(v) << 32;
            } else {
                // Bits 11:0 are reserved: queues are 4 KiB aligned.
                *r = (*r & !0xFFFF_FFFF) | u64::from(v & !0xFFF);
            }
        };
        match offset {
            // INTMS/INTMC are for pin-based and MSI interrupts; with MSI-X the host shall not
            // use them (1.4 section 3.1.3): kept only so that reads return what was written.
            reg::INTMS => self.intms |= v,
            reg::INTMC => self.intms &= !v,
            reg::CC => self.write_cc(v),
            reg::AQA => self.aqa = v & 0x0FFF_0FFF,
            0x28 | 0x2C => set_half(&mut self.asq, offset == 0x2C, v),
            0x30 | 0x34 => set_half(&mut self.acq, offset == 0x34, v),
            0x50 => self.write_cmbmsc((self.cmbmsc & !0xFFFF_FFFF) | u64::from(v)),
            0x54 => self.write_cmbmsc((self.cmbmsc & 0xFFFF_FFFF) | u64::from(v) << 32),
            o if o >= reg::DOORBELLS => self.doorbell(o, v),
            _ => {} // read-only or reserved: ignored
        }
    }

    fn write_cc(&mut self, v: u32) {
        let was = self.cc & cc::EN != 0;
        let now = v & cc::EN != 0;
        self.cc = v & 0x00FF_FFF1;
        if was && !now {
            self.reset();
        } else if !was && now {
            self.enable();
        }
        let shn = (v >> cc::SHN_SHIFT) & 3;
        if shn != 0 && self.csts & csts::SHST_MASK == 0 {
            // Normal or abrupt shutdown: commands complete synchronously, so all that is left
            // is to make the namespace's data durable.
            if self.backing.flush().is_err() {
                self.csts |= csts::CFS;
            }
            self.csts = (self.csts & !csts::SHST_MASK) | csts::SHST_COMPLETE;
        } else if shn == 0 {
            self.csts &= !csts::SHST_MASK;
        }
    }

    fn enable(&mut self) {
        let css = (self.cc >> cc::CSS_SHIFT) & 7;
        let mps = (self.cc >> cc::MPS_SHIFT) & 0xF;
        let asqs = self.aqa & 0xFFF;
        let acqs = (self.aqa >> 16) & 0xFFF;
        if css != 0 || mps > u32::from(self.cfg.mps_max) || asqs == 0 || acqs == 0 {
            self.csts |= csts::CFS;
            return;
        }
        self.page = 4096 << mps;
        let page_mask = self.page as u64 - 1;
        if self.asq & page_mask != 0 || self.acq & page_mask != 0 {
            self.csts |= csts::CFS;
            return;
        }
        self.sqs[0] = Some(Sq { base: self.asq, entries: asqs + 1, head: 0, tail: 0, cqid: 0 });
        self.cqs[0] = Some(Cq {
            base: self.acq,
            entries: acqs + 1,
            tail: 0,
            head: 0,
            phase: true,
            vector: 0,
            interrupts: true,
            attached_sqs: 1,
        });
        self.csts = (self.csts & !csts::SHST_MASK) | csts::RDY;
    }

    /// Controller reset (CC.EN 1 -> 0, 1.4 section 7.3.2): queues deleted, volatile state back
    /// to defaults. The namespace's data stays.
    fn reset(&mut self) {
        self.sqs.iter_mut().for_each(|q| *q = None);
        self.fetched.clear();
        self.staged.clear();
        self.cqs.iter_mut().for_each(|q| *q = None);
        self.csts = 0;
        self.io_sqs_allowed = self.cfg.max_io_queues;
        self.io_cqs_allowed = self.cfg.max_io_queues;
        self.features = DEFAULT_FEATURES;
        self.outstanding_aers = 0;
        self.next_sq = 0;
    }

    fn doorbell(&mut self, offset: u64, v: u32) {
        let index = (offset - reg::DOORBELLS) / 4;
        let qid = (index / 2) as usize;
        let is_cq = index % 2 == 1;
        if !self.enabled() {
            self.stats.invalid_doorbells += 1;
            return;
        }
        let ok = if is_cq {
            match self.cqs.get_mut(qid) {
                Some(Some(cq)) if v < cq.entries => {
                    // The new head must lie within the entries posted so far.
                    let posted = (cq.tail + cq.entries - cq.head) % cq.entries;
                    let advance = (v + cq.entries - cq.head) % cq.entries;
                    if advance <= posted {
                        cq.head = v;
                        true
                    } else {
                        false
                    }
                }
                _ => false,
            }
        } else {
            match self.sqs.get_mut(qid) {
                Some(Some(sq)) if v < sq.entries => {
                    sq.tail = v;
                    true
                }
                _ => false,
            }
        };
        if !ok {
            self.stats.invalid_doorbells += 1;
        }
    }
}
