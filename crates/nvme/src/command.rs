//! The 64-byte submission queue entry and the 16-byte completion queue entry (NVMe base
//! specification 1.4 sections 4.2 "Submission Queue Entry - Command Format" and 4.6 "Completion
//! Queue Entry"), and the pure decoders that turn an SQE into an admin or NVM command.
//!
//! Everything here is a pure function over bytes from the host: a decoder never panics and
//! never allocates; it either yields a command whose fields are all within the ranges the
//! controller accepts, or the [`Status`] the specification names for the first bad field.
//! Checks that need controller state (queue ids in use, namespace size, MDTS) are made by the
//! controller after decoding. All fields are little-endian, as on the PCIe bus.

use crate::status::Status;

/// Admin command opcodes (1.4 section 5, Figure 139).
pub mod admin_opcode {
    /// Delete I/O Submission Queue.
    pub const DELETE_SQ: u8 = 0x00;
    /// Create I/O Submission Queue.
    pub const CREATE_SQ: u8 = 0x01;
    /// Get Log Page.
    pub const GET_LOG_PAGE: u8 = 0x02;
    /// Delete I/O Completion Queue.
    pub const DELETE_CQ: u8 = 0x04;
    /// Create I/O Completion Queue.
    pub const CREATE_CQ: u8 = 0x05;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Abort.
    pub const ABORT: u8 = 0x08;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Get Features.
    pub const GET_FEATURES: u8 = 0x0A;
    /// Asynchronous Event Request.
    pub const ASYNC_EVENT_REQUEST: u8 = 0x0C;
}

/// NVM command set opcodes (1.4 section 6, Figure 346).
pub mod nvm_opcode {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
    /// Write Zeroes.
    pub const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management.
    pub const DATASET_MANAGEMENT: u8 = 0x09;
}

/// Feature identifiers (1.4 section 5.21.1, Figure 271) that Get/Set Features accept.
pub mod feature {
    /// Arbitration.
    pub const ARBITRATION: u8 = 0x01;
    /// Power Management.
    pub const POWER_MANAGEMENT: u8 = 0x02;
    /// Temperature Threshold.
    pub const TEMPERATURE_THRESHOLD: u8 = 0x04;
    /// Volatile Write Cache.
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    /// Number of Queues.
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    /// Interrupt Coalescing.
    pub const INTERRUPT_COALESCING: u8 = 0x08;
    /// Interrupt Vector Configuration.
    pub const INTERRUPT_VECTOR_CONFIG: u8 = 0x09;
    /// Write Atomicity Normal.
    pub const WRITE_ATOMICITY: u8 = 0x0A;
    /// Asynchronous Event Configuration.
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0B;
}

/// Size of a submission queue entry (CC.IOSQES = 6).
pub const SQE_LEN: usize = 64;
/// Size of a completion queue entry (CC.IOCQES = 4).
pub const CQE_LEN: usize = 16;

/// A submission queue entry, field by field (common command format, 1.4 Figure 105).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sqe {
    /// CDW0 bits 7:0.
    pub opcode: u8,
    /// CDW0 bits 9:8, fused operation.
    pub fuse: u8,
    /// CDW0 bits 15:14, PRP or SGL for data transfer.
    pub psdt: u8,
    /// CDW0 bits 31:16, command identifier.
    pub cid: u16,
    /// Namespace identifier.
    pub nsid: u32,
    /// CDW2 and CDW3 (command specific, reserved in the commands implemented here).
    pub cdw2: u32,
    /// CDW3.
    pub cdw3: u32,
    /// Metadata pointer.
    pub mptr: u64,
    /// PRP entry 1.
    pub prp1: u64,
    /// PRP entry 2.
    pub prp2: u64,
    /// CDW10 to CDW15.
    pub cdw: [u32; 6],
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from(le32(b, at)) | (u64::from(le32(b, at + 4)) << 32)
}

impl Sqe {
    /// Parses 64 bytes. Every bit pattern is a valid `Sqe`; meaning is checked by the decoders.
    pub fn parse(b: &[u8; SQE_LEN]) -> Sqe {
        let dw0 = le32(b, 0);
        Sqe {
            opcode: dw0 as u8,
            fuse: ((dw0 >> 8) & 3) as u8,
            psdt: ((dw0 >> 14) & 3) as u8,
            cid: (dw0 >> 16) as u16,
            nsid: le32(b, 4),
            cdw2: le32(b, 8),
            cdw3: le32(b, 12),
            mptr: le64(b, 16),
            prp1: le64(b, 24),
            prp2: le64(b, 32),
            cdw: [le32(b, 40), le32(b, 44), le32(b, 48), le32(b, 52), le32(b, 56), le32(b, 60)],
        }
    }

    /// Emits the 64-byte entry (CDW0 bits 13:10 are reserved and written as zero).
    pub fn emit(&self, b: &mut [u8; SQE_LEN]) {
        let dw0 = u32::from(self.opcode)
            | (u32::from(self.fuse & 3) << 8)
            | (u32::from(self.psdt & 3) << 14)
            | (u32::from(self.cid) << 16);
        b[0..4].copy_from_slice(&dw0.to_le_bytes());
        b[4..8].copy_from_slice(&self.nsid.to_le_bytes());
        b[8..12].copy_from_slice(&self.cdw2.to_le_bytes());
        b[12..16].copy_from_slice(&self.cdw3.to_le_bytes());
        b[16..24].copy_from_slice(&self.mptr.to_le_bytes());
        b[24..32].copy_from_slice(&self.prp1.to_le_bytes());
        b[32..40].copy_from_slice(&self.prp2.to_le_bytes());
        for (i, dw) in self.cdw.iter().enumerate() {
            b[40 + 4 * i..44 + 4 * i].copy_from_slice(&dw.to_le_bytes());
        }
    }

    /// The entry as bytes.
    pub fn to_bytes(&self) -> [u8; SQE_LEN] {
        let mut b = [0u8; SQE_LEN];
        self.emit(&mut b);
        b
    }

    /// CDW10 .. CDW15 by their spec number (10..=15).
    pub fn dw(&self, n: usize) -> u32 {
        self.cdw[n - 10]
    }
}

/// A completion queue entry (1.4 Figure 124).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// DW0, command specific.
    pub dw0: u32,
    /// DW1, command specific.
    pub dw1: u32,
    /// SQ Head Pointer.
    pub sq_head: u16,
    /// SQ Identifier.
    pub sq_id: u16,
    /// Command Identifier.
    pub cid: u16,
    /// Phase Tag.
    pub phase: bool,
    /// Status.
    pub status: Status,
}

impl Completion {
    /// Parses 16 bytes.
    pub fn parse(b: &[u8; CQE_LEN]) -> Completion {
        let dw2 = le32(b, 8);
        let dw3 = le32(b, 12);
        Completion {
            dw0: le32(b, 0),
            dw1: le32(b, 4),
            sq_head: dw2 as u16,
            sq_id: (dw2 >> 16) as u16,
            cid: dw3 as u16,
            phase: dw3 & (1 << 16) != 0,
            status: Status::from_field((dw3 >> 17) as u16),
        }
    }

    /// Emits 16 bytes.
    pub fn emit(&self, b: &mut [u8; CQE_LEN]) {
        let dw2 = u32::from(self.sq_head) | (u32::from(self.sq_id) << 16);
        let dw3 =
            u32::from(self.cid) | (u32::from(self.phase) << 16) | (u32::from(self.status.to_field()) << 17);
        b[0..4].copy_from_slice(&self.dw0.to_le_bytes());
        b[4..8].copy_from_slice(&self.dw1.to_le_bytes());
        b[8..12].copy_from_slice(&dw2.to_le_bytes());
        b[12..16].copy_from_slice(&dw3.to_le_bytes());
    }
}

/// The data pointer of a command: PRP entry 1 and 2, or (an I/O command with PSDT 01b) the
/// first SGL descriptor, whose 16 bytes the same two fields hold ([`crate::sgl::sgl1`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataPtr {
    /// PRP entry 1 (SGL1 bytes 7:0).
    pub prp1: u64,
    /// PRP entry 2: second page or PRP list pointer (SGL1 bytes 15:8).
    pub prp2: u64,
    /// The fields hold SGL1, not PRPs.
    pub sgl: bool,
}

/// A decoded admin command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminCommand {
    /// Create I/O Completion Queue (1.4 section 5.3).
    CreateCq {
        /// Queue identifier.
        qid: u16,
        /// Entries (the 0's based QSIZE plus one; at least 2).
        entries: u32,
        /// Base address (PRP1).
        base: u64,
        /// Physically contiguous.
        contiguous: bool,
        /// Interrupts enabled.
        interrupts: bool,
        /// MSI-X vector.
        vector: u16,
    },
    /// Create I/O Submission Queue (1.4 section 5.4).
    CreateSq {
        /// Queue identifier.
        qid: u16,
        /// Entries (at least 2).
        entries: u32,
        /// Base address (PRP1).
        base: u64,
        /// Physically contiguous.
        contiguous: bool,
        /// Completion queue it posts to.
        cqid: u16,
    },
    /// Delete I/O Completion Queue (1.4 section 5.5).
    DeleteCq {
        /// Queue identifier.
        qid: u16,
    },
    /// Delete I/O Submission Queue (1.4 section 5.6).
    DeleteSq {
        /// Queue identifier.
        qid: u16,
    },
    /// Identify (1.4 section 5.15).
    Identify {
        /// Controller or Namespace Structure.
        cns: u8,
        /// Namespace the structure is about.
        nsid: u32,
        /// Where the 4096 bytes go.
        data: DataPtr,
    },
    /// Abort (1.4 section 5.1).
    Abort {
        /// Submission queue of the command to abort.
        sqid: u16,
        /// Its command identifier.
        cid: u16,
    },
    /// Set Features (1.4 section 5.21).
    SetFeatures {
        /// Feature identifier.
        fid: u8,
        /// Save across resets.
        save: bool,
        /// CDW11 (the value for most features).
        value: u32,
    },
    /// Get Features (1.4 section 5.14).
    GetFeatures {
        /// Feature identifier.
        fid: u8,
        /// Select: 0 current, 1 default, 2 saved, 3 supported capabilities.
        select: u8,
    },
    /// Get Log Page (1.4 section 5.14), the mandatory pages.
    GetLogPage {
        /// Log page identifier.
        lid: u8,
        /// Bytes to transfer (NUMD + 1 dwords).
        len_bytes: u32,
        /// Offset into the log page in bytes.
        offset_bytes: u64,
        /// Where the data goes.
        data: DataPtr,
    },
    /// Asynchronous Event Request.
    AsyncEventRequest,
}

/// A decoded NVM command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoCommand {
    /// Read (1.4 section 6.9) or Write (6.15).
    ReadWrite {
        /// True for Write.
        write: bool,
        /// Namespace.
        nsid: u32,
        /// Starting LBA.
        slba: u64,
        /// Number of logical blocks (NLB plus one).
        blocks: u32,
        /// Force Unit Access.
        fua: bool,
        /// Data pointer.
        data: DataPtr,
    },
    /// Flush (1.4 section 6.8).
    Flush {
        /// Namespace (or all with 0xFFFF_FFFF).
        nsid: u32,
    },
    /// Write Zeroes (1.4 section 6.16).
    WriteZeroes {
        /// Namespace.
        nsid: u32,
        /// Starting LBA.
        slba: u64,
        /// Number of logical blocks.
        blocks: u32,
        /// Deallocate.
        deallocate: bool,
        /// Force Unit Access.
        fua: bool,
    },
    /// Dataset Management (1.4 section 6.7).
    DatasetManagement {
        /// Namespace.
        nsid: u32,
        /// Number of 16-byte ranges (NR plus one, 1..=256).
        ranges: u16,
        /// Attribute: deallocate.
        deallocate: bool,
        /// Where the range list is.
        data: DataPtr,
    },
}

/// Checks the fields common to every command: no fused operations, and PRPs, or where `sgl`
/// allows it an SGL for the data (PSDT 01b; not 10b, an SGL for metadata, which this controller
/// has none of).
fn check_common(sqe: &Sqe, sgl: bool) -> Result<(), Status> {
    if sqe.fuse != 0 || !(sqe.psdt == 0 || sgl && sqe.psdt == 1) {
        return Err(Status::INVALID_FIELD);
    }
    Ok(())
}

/// Decodes an admin command. Queue ids, sizes and vectors are range-checked by the controller,
/// which knows its limits; here only what the SQE alone determines.
pub fn decode_admin(sqe: &Sqe) -> Result<AdminCommand, Status> {
    use admin_opcode::*;
    check_common(sqe, false)?;
    let data = DataPtr { prp1: sqe.prp1, prp2: sqe.prp2, sgl: false };
    let dw10 = sqe.dw(10);
    let dw11 = sqe.dw(11);
    Ok(match sqe.opcode {
        CREATE_CQ => AdminCommand::CreateCq {
            qid: dw10 as u16,
            entries: (dw10 >> 16) + 1,
            base: sqe.prp1,
            contiguous: dw11 & 1 != 0,
            interrupts: dw11 & 2 != 0,
            vector: (dw11 >> 16) as u16,
        },
        CREATE_SQ => AdminCommand::CreateSq {
            qid: dw10 as u16,
            entries: (dw10 >> 16) + 1,
            base: sqe.prp1,
            contiguous: dw11 & 1 != 0,
            cqid: (dw11 >> 16) as u16,
        },
        DELETE_CQ => AdminCommand::DeleteCq { qid: dw10 as u16 },
        DELETE_SQ => AdminCommand::DeleteSq { qid: dw10 as u16 },
        IDENTIFY => AdminCommand::Identify { cns: dw10 as u8, nsid: sqe.nsid, data },
        ABORT => AdminCommand::Abort { sqid: dw10 as u16, cid: (dw10 >> 16) as u16 },
        SET_FEATURES => {
            AdminCommand::SetFeatures { fid: dw10 as u8, save: dw10 & (1 << 31) != 0, value: dw11 }
        }
        GET_FEATURES => {
            let select = ((dw10 >> 8) & 7) as u8;
            if select > 3 {
                return Err(Status::INVALID_FIELD);
            }
            AdminCommand::GetFeatures { fid: dw10 as u8, select }
        }
        GET_LOG_PAGE => {
            // NUMDL in CDW10 31:16, NUMDU in CDW11 15:0 (0's based dwords); offset in CDW12/13.
            let numd = (u64::from(dw11 & 0xFFFF) << 16 | u64::from(dw10 >> 16)) + 1;
            let offset_bytes = u64::from(sqe.dw(12)) | (u64::from(sqe.dw(13)) << 32);
            if numd * 4 > u64::from(u32::MAX) || offset_bytes & 3 != 0 {
                return Err(Status::INVALID_FIELD);
            }
            AdminCommand::GetLogPage { lid: dw10 as u8, len_bytes: (numd * 4) as u32, offset_bytes, data }
        }
        ASYNC_EVENT_REQUEST => AdminCommand::AsyncEventRequest,
        _ => return Err(Status::INVALID_OPCODE),
    })
}

/// Decodes an NVM command set I/O command.
pub fn decode_io(sqe: &Sqe) -> Result<IoCommand, Status> {
    use nvm_opcode::*;
    // PCIe admin commands use PRPs only (1.4 section 4.4); I/O commands may use an SGL.
    check_common(sqe, true)?;
    let data = DataPtr { prp1: sqe.prp1, prp2: sqe.prp2, sgl: sqe.psdt == 1 };
    let slba = u64::from(sqe.dw(10)) | (u64::from(sqe.dw(11)) << 32);
    let dw12 = sqe.dw(12);
    let blocks = (dw12 & 0xFFFF) + 1;
    let fua = dw12 & (1 << 30) != 0;
    Ok(match sqe.opcode {
        READ | WRITE => {
            // PRINFO (29:26) asks for protection information, which no format here has.
            if (dw12 >> 26) & 0xF != 0 {
                return Err(Status::INVALID_FIELD);
            }
            IoCommand::ReadWrite { write: sqe.opcode == WRITE, nsid: sqe.nsid, slba, blocks, fua, data }
        }
        FLUSH => IoCommand::Flush { nsid: sqe.nsid },
        WRITE_ZEROES => {
            if (dw12 >> 26) & 0xF != 0 {
                return Err(Status::INVALID_FIELD);
            }
            IoCommand::WriteZeroes { nsid: sqe.nsid, slba, blocks, deallocate: dw12 & (1 << 25) != 0, fua }
        }
        DATASET_MANAGEMENT => IoCommand::DatasetManagement {
            nsid: sqe.nsid,
            ranges: (sqe.dw(10) & 0xFF) as u16 + 1,
            deallocate: sqe.dw(11) & 4 != 0,
            data,
        },
        _ => return Err(Status::INVALID_OPCODE),
    })
}

/// The fuzz target's body (`fuzz/fuzz_targets/nvme_command.rs`): decodes arbitrary bytes as an
/// SQE with both decoders and checks the invariants: an entry re-emits to the same bytes (except
/// the reserved CDW0 bits), decoded sizes are within their field widths, and a completion entry
/// round-trips. Panics only if an invariant breaks.
#[cfg(any(test, fuzzing))]
pub fn fuzz_command(data: &[u8]) {
    let Some(bytes) = data.get(..SQE_LEN) else { return };
    let mut raw = [0u8; SQE_LEN];
    raw.copy_from_slice(bytes);
    let sqe = Sqe::parse(&raw);
    let mut again = sqe.to_bytes();
    // CDW0 bits 13:10 are reserved: the emitter writes zero there.
    again[1] |= raw[1] & 0x3C;
    assert_eq!(again, raw, "SQE does not round-trip");
    match decode_admin(&sqe) {
        Ok(AdminCommand::CreateCq { entries, .. }) | Ok(AdminCommand::CreateSq { entries, .. }) => {
            assert!((1..=65536).contains(&entries))
        }
        Ok(AdminCommand::GetLogPage { len_bytes, .. }) => assert!(len_bytes >= 4 && len_bytes % 4 == 0),
        Ok(_) => {}
        Err(status) => assert!(!status.is_success()),
    }
    match decode_io(&sqe) {
        Ok(IoCommand::ReadWrite { blocks, .. }) | Ok(IoCommand::WriteZeroes { blocks, .. }) => {
            assert!((1..=65536).contains(&blocks))
        }
        Ok(IoCommand::DatasetManagement { ranges, .. }) => assert!((1..=256).contains(&ranges)),
        Ok(_) => {}
        Err(status) => assert!(!status.is_success()),
    }
    if let Some(cqe_bytes) = data.get(SQE_LEN..SQE_LEN + CQE_LEN) {
        let mut raw = [0u8; CQE_LEN];
        raw.copy_from_slice(cqe_bytes);
        // Bits 29:28 (CRD) and 30 (More) of the status field are not modelled: mask them.
        raw[15] &= !0x70;
        let cqe = Completion::parse(&raw);
        let mut out = [0u8; CQE_LEN];
        cqe.emit(&mut out);
        assert_eq!(out, raw, "CQE does not round-trip");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqe_fixture() {
        // A Read of 8 blocks at LBA 0x1_0000_0002, CID 0x1234, NSID 1.
        let mut b = [0u8; SQE_LEN];
        b[0] = 0x02;
        b[2] = 0x34;
        b[3] = 0x12;
        b[4] = 1;
        b[24..32].copy_from_slice(&0x1000u64.to_le_bytes());
        b[40..44].copy_from_slice(&2u32.to_le_bytes());
        b[44..48].copy_from_slice(&1u32.to_le_bytes());
        b[48..52].copy_from_slice(&(7u32 | 1 << 30).to_le_bytes());
        let sqe = Sqe::parse(&b);
        assert_eq!(sqe.cid, 0x1234);
        assert_eq!(sqe.to_bytes(), b);
        assert_eq!(
            decode_io(&sqe),
            Ok(IoCommand::ReadWrite {
                write: false,
                nsid: 1,
                slba: 0x1_0000_0002,
                blocks: 8,
                fua: true,
                data: DataPtr { prp1: 0x1000, prp2: 0, sgl: false }
            })
        );
        // As an admin command, opcode 2 is Get Log Page, whose CDW12 offset must be dword aligned.
        assert_eq!(decode_admin(&sqe), Err(Status::INVALID_FIELD));
    }

    #[test]
    fn cqe_fixture() {
        let c = Completion {
            dw0: 7,
            dw1: 0,
            sq_head: 5,
            sq_id: 3,
            cid: 0xBEEF,
            phase: true,
            status: Status::LBA_OUT_OF_RANGE,
        };
        let mut b = [0u8; CQE_LEN];
        c.emit(&mut b);
        assert_eq!(b, [7, 0, 0, 0, 0, 0, 0, 0, 5, 0, 3, 0, 0xEF, 0xBE, 0x01, 0x81]);
        assert_eq!(Completion::parse(&b), c);
    }

    #[test]
    fn fused_rejected_and_sgls_only_for_io_data() {
        let sqe = Sqe { opcode: nvm_opcode::READ, fuse: 1, ..Sqe::default() };
        assert_eq!(decode_io(&sqe), Err(Status::INVALID_FIELD));
        let sqe = Sqe { opcode: nvm_opcode::READ, psdt: 1, prp1: 0x1000, prp2: 512, ..Sqe::default() };
        match decode_io(&sqe) {
            Ok(IoCommand::ReadWrite { data, .. }) => {
                assert_eq!(data, DataPtr { prp1: 0x1000, prp2: 512, sgl: true })
            }
            other => panic!("an SGL read: {other:?}"),
        }
        // An SGL for metadata (10b), the reserved 11b, and SGLs in admin commands.
        for psdt in [2, 3] {
            let sqe = Sqe { opcode: nvm_opcode::READ, psdt, ..Sqe::default() };
            assert_eq!(decode_io(&sqe), Err(Status::INVALID_FIELD));
        }
        let sqe = Sqe { opcode: admin_opcode::IDENTIFY, psdt: 1, ..Sqe::default() };
        assert_eq!(decode_admin(&sqe), Err(Status::INVALID_FIELD));
        let sqe = Sqe { opcode: 0x7F, ..Sqe::default() };
        assert_eq!(decode_io(&sqe), Err(Status::INVALID_OPCODE));
        assert_eq!(decode_admin(&sqe), Err(Status::INVALID_OPCODE));
    }

    #[test]
    fn fuzz_corpus_passes() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/corpus/nvme_command");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            fuzz_command(&std::fs::read(entry.unwrap().path()).unwrap());
            n += 1;
        }
        assert!(n >= 5);
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..96)) {
            fuzz_command(&bytes);
        }
    }
}
