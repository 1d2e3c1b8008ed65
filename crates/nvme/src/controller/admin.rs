//! The admin command set (device side): execution of admin commands, as a second
//! `impl Controller` block. NVMe base specification 1.4 section 5: Create and Delete I/O
//! Completion and Submission Queue, Identify (CNS 0 namespace, 1 controller, 2 active namespace
//! list), Get and Set Features, Abort (reports "not aborted": commands complete synchronously),
//! Get Log Page (error information, SMART / health, firmware slot) and Asynchronous Event Request
//! (held outstanding up to AERL+1; no events are generated).

use super::{cc, CmbView, Controller, Cq, Features, Sq, DEFAULT_FEATURES, PCI_VENDOR_ID};
use crate::command::{decode_admin, feature, AdminCommand, Sqe};
use crate::status::Status;
use crate::InterruptSink;

/// Asynchronous Event Request Limit (0's based) reported in Identify.
const AERL: u8 = 3;
/// Abort Command Limit (0's based) reported in Identify.
const ACL: u8 = 3;

impl Controller {
    /// Executes admin command `sqe`: `Ok(Some(dw0))` completes it with success and that DW0,
    /// `Ok(None)` holds it outstanding (Asynchronous Event Request), `Err` completes it with
    /// that status.
    pub(super) fn exec_admin(
        &mut self,
        sqe: &Sqe,
        mem: &mut CmbView<'_>,
        irq: &mut dyn InterruptSink,
    ) -> Result<Option<u32>, Status> {
        match decode_admin(sqe)? {
            AdminCommand::CreateCq { qid, entries, base, contiguous, interrupts, vector } => {
                if qid == 0 || qid > self.io_cqs_allowed || self.cqs[usize::from(qid)].is_some() {
                    return Err(Status::INVALID_QUEUE_ID);
                }
                self.check_queue(entries, base, contiguous, (self.cc >> cc::IOCQES_SHIFT) & 0xF, 4)?;
                if vector >= self.cfg.msix_vectors {
                    return Err(Status::INVALID_VECTOR);
                }
                self.cqs[usize::from(qid)] = Some(Cq {
                    base,
                    entries,
                    tail: 0,
                    head: 0,
                    phase: true,
                    vector,
                    interrupts,
                    attached_sqs: 0,
                });
                Ok(Some(0))
            }
            AdminCommand::CreateSq { qid, entries, base, contiguous, cqid } => {
                if qid == 0 || qid > self.io_sqs_allowed || self.sqs[usize::from(qid)].is_some() {
                    return Err(Status::INVALID_QUEUE_ID);
                }
                if cqid == 0 || cqid > self.io_cqs_allowed || self.cqs[usize::from(cqid)].is_none() {
                    return Err(Status::CQ_INVALID);
                }
                self.check_queue(entries, base, contiguous, (self.cc >> cc::IOSQES_SHIFT) & 0xF, 6)?;
                if let Some(cq) = self.cqs[usize::from(cqid)].as_mut() {
                    cq.attached_sqs += 1;
                }
                self.fetched.clear();
                self.staged.clear();
                self.sqs[usize::from(qid)] = Some(Sq { base, entries, head: 0, tail: 0, cqid });
                Ok(Some(0))
            }
            AdminCommand::DeleteSq { qid } => {
                if qid == 0 || qid > self.cfg.max_io_queues {
                    return Err(Status::INVALID_QUEUE_ID);
                }
                if self.sqs[usize::from(qid)].is_none() {
                    return Err(Status::INVALID_QUEUE_ID);
                }
                // 1.4 section 5.6: commands submitted to the queue complete (or are aborted)
                // before the deletion does. Commands run synchronously, so run what the host
                // submitted; entries that find the CQ full are dropped and counted.
                while self.run_sq(usize::from(qid), mem, irq, false) > 0 {}
                self.fetched.clear();
                self.staged.clear();
                let sq = self.sqs[usize::from(qid)].take().ok_or(Status::INVALID_QUEUE_ID)?;
                if sq.head != sq.tail {
                    self.stats.dropped_on_deletion +=
                        u64::from((sq.tail + sq.entries - sq.head) % sq.entries);
                }
                if let Some(cq) = self.cqs[usize::from(sq.cqid)].as_mut() {
                    cq.attached_sqs -= 1;
                }
                Ok(Some(0))
            }
            AdminCommand::DeleteCq { qid } => {
                if qid == 0 || qid > self.cfg.max_io_queues {
                    return Err(Status::INVALID_QUEUE_ID);
                }
                match self.cqs[usize::from(qid)] {
                    None => Err(Status::INVALID_QUEUE_ID),
                    Some(cq) if cq.attached_sqs > 0 => Err(Status::INVALID_QUEUE_DELETION),
                    Some(_) => {
                        self.cqs[usize::from(qid)] = None;
                        Ok(Some(0))
                    }
                }
            }
            AdminCommand::Identify { cns, nsid, data } => {
                let page = self.identify(cns, nsid)?;
                self.data.resize(page.len().max(self.data.len()), 0);
                self.data[..4096].copy_from_slice(&page);
                self.transfer(mem, data, 4096, true)?;
                Ok(Some(0))
            }
            AdminCommand::Abort { sqid, .. } => {
                if usize::from(sqid) >= self.sqs.len() || self.sqs[usize::from(sqid)].is_none() {
                    return Err(Status::INVALID_QUEUE_ID);
                }
                // DW0 bit 0 set: the command was not aborted (it had already completed, or it
                // will be executed when fetched).
                Ok(Some(1))
            }
            AdminCommand::SetFeatures { fid, save, value } => {
                if save {
                    return Err(Status::FEATURE_NOT_SAVEABLE);
                }
                self.set_feature(fid, value).map(Some)
            }
            AdminCommand::GetFeatures { fid, select } => {
                let current = self.get_feature(fid, &self.features)?;
                Ok(Some(match select {
                    0 | 2 => current,
                    1 => self.get_feature(fid, &DEFAULT_FEATURES)?,
                    _ => 0b100, // changeable, not saveable, not namespace specific
                }))
            }
            AdminCommand::GetLogPage { lid, len_bytes, offset_bytes, data } => {
                let log = self.log_page(lid)?;
                if offset_bytes >= log.len() as u64 || len_bytes as usize > self.mdts_bytes() {
                    return Err(Status::INVALID_FIELD);
                }
                let len = len_bytes as usize;
                self.data.clear();
                self.data.resize(len, 0);
                let from = &log[offset_bytes as usize..];
                let n = from.len().min(len);
                self.data[..n].copy_from_slice(&from[..n]);
                self.transfer(mem, data, len, true)?;
                Ok(Some(0))
            }
            AdminCommand::AsyncEventRequest => {
                if self.outstanding_aers > AERL {
                    return Err(Status::AER_LIMIT);
                }
                self.outstanding_aers += 1;
                Ok(None)
            }
        }
    }

    fn check_queue(
        &self,
        entries: u32,
        base: u64,
        contiguous: bool,
        es: u32,
        want_es: u32,
    ) -> Result<(), Status> {
        if entries < 2 || entries > self.cfg.max_queue_entries {
            return Err(Status::INVALID_QUEUE_SIZE);
        }
        // CAP.CQR = 1: only physically contiguous queues; the entry size must be programmed.
        if !contiguous || es != want_es || base == 0 {
            return Err(Status::INVALID_FIELD);
        }
        if base & (self.page as u64 - 1) != 0 {
            return Err(Status::PRP_OFFSET_INVALID);
        }
        Ok(())
    }

    fn set_feature(&mut self, fid: u8, value: u32) -> Result<u32, Status> {
        let f = &mut self.features;
        match fid {
            feature::NUMBER_OF_QUEUES => {
                let (nsqr, ncqr) = (value & 0xFFFF, value >> 16);
                if nsqr == 0xFFFF || ncqr == 0xFFFF {
                    return Err(Status::INVALID_FIELD);
                }
                if self.sqs[1..].iter().any(Option::is_some) || self.cqs[1..].iter().any(Option::is_some) {
                    return Err(Status::COMMAND_SEQUENCE_ERROR);
                }
                let max = u32::from(self.cfg.max_io_queues);
                self.io_sqs_allowed = (nsqr + 1).min(max) as u16;
                self.io_cqs_allowed = (ncqr + 1).min(max) as u16;
                return self.get_feature(fid, &self.features);
            }
            feature::ARBITRATION => f.arbitration = value,
            feature::POWER_MANAGEMENT => {
                // One power state (NPSS = 0).
                if value & 0x1F != 0 {
                    return Err(Status::INVALID_FIELD);
                }
                f.power_management = value & 0xFF;
            }
            feature::TEMPERATURE_THRESHOLD => f.temperature_threshold = value & 0x3F_FFFF,
            feature::VOLATILE_WRITE_CACHE => f.volatile_write_cache = value & 1,
            feature::INTERRUPT_COALESCING => f.interrupt_coalescing = value & 0xFFFF,
            feature::WRITE_ATOMICITY => f.write_atomicity = value & 1,
            feature::ASYNC_EVENT_CONFIG => f.async_event_config = value,
            _ => return Err(Status::INVALID_FIELD),
        }
        Ok(0)
    }

    fn get_feature(&self, fid: u8, f: &Features) -> Result<u32, Status> {
        Ok(match fid {
            feature::NUMBER_OF_QUEUES => {
                u32::from(self.io_sqs_allowed - 1) | u32::from(self.io_cqs_allowed - 1) << 16
            }
            feature::ARBITRATION => f.arbitration,
            feature::POWER_MANAGEMENT => f.power_management,
            feature::TEMPERATURE_THRESHOLD => f.temperature_threshold,
            feature::VOLATILE_WRITE_CACHE => f.volatile_write_cache,
            feature::INTERRUPT_COALESCING => f.interrupt_coalescing,
            feature::WRITE_ATOMICITY => f.write_atomicity,
            feature::ASYNC_EVENT_CONFIG => f.async_event_config,
            _ => return Err(Status::INVALID_FIELD),
        })
    }

    fn log_page(&self, lid: u8) -> Result<Vec<u8>, Status> {
        match lid {
            // Error Information: one all-zero entry (no errors logged).
            0x01 => Ok(vec![0; 64]),
            0x02 => {
                // SMART / Health: composite temperature 300 K, data units in thousands of 512 B.
                let mut p = vec![0u8; 512];
                p[1..3].copy_from_slice(&300u16.to_le_bytes());
                p[3] = 100; // available spare
                p[4] = 10; // spare threshold
                let units = |b: u64| u128::from(b.div_ceil(512_000));
                p[32..48].copy_from_slice(&units(self.stats.bytes_read).to_le_bytes());
                p[48..64].copy_from_slice(&units(self.stats.bytes_written).to_le_bytes());
                Ok(p)
            }
            0x03 => {
                let mut p = vec![0u8; 512];
                p[0] = 1; // slot 1 active
                p[8..16].copy_from_slice(&fixed::<8>(env!("CARGO_PKG_VERSION")));
                Ok(p)
            }
            _ => Err(Status::INVALID_LOG_PAGE),
        }
    }

    fn identify(&self, cns: u8, nsid: u32) -> Result<[u8; 4096], Status> {
        let mut p = [0u8; 4096];
        match cns {
            0x00 => {
                self.check_nsid(nsid)?;
                let b = self.blocks.to_le_bytes();
                p[0..8].copy_from_slice(&b); // NSZE
                p[8..16].copy_from_slice(&b); // NCAP
                p[16..24].copy_from_slice(&b); // NUSE
                p[24] = 0; // NSFEAT
                p[25] = 0; // NLBAF: one format (0's based)
                p[26] = 0; // FLBAS: format 0, no metadata
                p[33] = 0b1001; // DLFEAT: deallocated blocks read as zero; Write Zeroes may deallocate
                let lbads = self.cfg.lba_size.trailing_zeros();
                p[128..132].copy_from_slice(&(lbads << 16).to_le_bytes()); // LBAF0: MS 0, LBADS, RP 0
            }
            0x01 => {
                p[0..2].copy_from_slice(&PCI_VENDOR_ID.to_le_bytes());
                p[2..4].copy_from_slice(&PCI_VENDOR_ID.to_le_bytes());
                p[4..24].copy_from_slice(&fixed::<20>(&self.cfg.serial));
                p[24..64].copy_from_slice(&fixed::<40>(&self.cfg.model));
                p[64..72].copy_from_slice(&fixed::<8>(env!("CARGO_PKG_VERSION")));
                p[72] = 6; // RAB
                p[77] = self.cfg.mdts;
                p[78..80].copy_from_slice(&1u16.to_le_bytes()); // CNTLID
                p[80..84].copy_from_slice(&0x0001_0400u32.to_le_bytes()); // VER
                p[111] = 1; // CNTRLTYPE: I/O controller
                p[258] = ACL;
                p[259] = AERL;
                p[260] = 0b010; // FRMW: one firmware slot, writable
                p[261] = 0; // LPA
                p[262] = 0; // ELPE: 1 entry (0's based)
                p[263] = 0; // NPSS: one power state
                p[512] = 0x66; // SQES
                p[513] = 0x44; // CQES
                p[514..516].copy_from_slice(&(self.cfg.max_queue_entries.min(65535) as u16).to_le_bytes());
                p[516..520].copy_from_slice(&1u32.to_le_bytes()); // NN
                p[520..522].copy_from_slice(&0b1100u16.to_le_bytes()); // ONCS: DSM, Write Zeroes
                p[525] = 1; // VWC present
                p[536..540].copy_from_slice(&1u32.to_le_bytes()); // SGLS: SGLs, no alignment rule
                p[526..528].copy_from_slice(&0u16.to_le_bytes()); // AWUN
                let subnqn = format!("nqn.2024-01.io.lanbus:nvme:{}", self.cfg.serial);
                let n = subnqn.len().min(255);
                p[768..768 + n].copy_from_slice(&subnqn.as_bytes()[..n]);
                // Power state 0: 25 W (units of 0.01 W).
                p[2048..2050].copy_from_slice(&2500u16.to_le_bytes());
            }
            0x02 => {
                if nsid >= 0xFFFF_FFFE {
                    return Err(Status::INVALID_NAMESPACE);
                }
                if nsid < 1 {
                    p[0..4].copy_from_slice(&1u32.to_le_bytes());
                }
            }
            _ => return Err(Status::INVALID_FIELD),
        }
        Ok(p)
    }
}

/// An ASCII field padded with spaces (Identify strings).
fn fixed<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [b' '; N];
    for (o, c) in out.iter_mut().zip(s.bytes().filter(|c| c.is_ascii_graphic() || *c == b' ')) {
        *o = c;
    }
    out
}
