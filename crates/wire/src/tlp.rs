//! PCIe Transaction Layer Packets as they appear on a link: header, data payload, optional digest.
//!
//! Layer: wire (byte views only; the meaning of the fields, request building, completion
//! splitting and reassembly live in `lanbus-pcie`). Implements the TLP header formats of the PCI
//! Express Base Specification, section 2.2 (2.2.1 common fields, 2.2.7 memory/I/O/configuration
//! requests, 2.2.9 completions, 2.2.6.2 10-bit tags). TLP prefixes (Fmt 100b) are not supported.
//!
//! ```text
//! DW0: |Fmt|  Type   |T9| TC |T8|A2|LN|TH|TD|EP|Attr|AT|   Length   |
//! DW1 (request):    | Requester ID | Tag[7:0] | Last BE | First BE |
//! DW1 (completion): | Completer ID | Status|BCM| Byte Count[11:0]  |
//! DW2 (completion): | Requester ID | Tag[7:0] |R| Lower Address   |
//! DW2/3 (memory):   address[63:32] (4 DW only), address[31:2] | PH
//! DW2 (config):     | Completer ID | Ext Reg | Register[7:2] |00  |
//! ```
//!
//! Invariant: once [`Packet::new_checked`] has succeeded, the Fmt/Type pair names a TLP the spec
//! defines, the buffer holds the whole header, payload and digest it declares, and no accessor
//! panics. Bytes after [`Packet::total_len`] are not part of the TLP and are ignored.

use crate::{Error, Result};

mod field {
    pub const FMT_TYPE: usize = 0;
    pub const FLAGS1: usize = 1;
    pub const FLAGS2: usize = 2;
    pub const LENGTH_LO: usize = 3;
    /// Requests: requester ID; completions: completer ID.
    pub const ID1: core::ops::Range<usize> = 4..6;
    pub const REQ_TAG: usize = 6;
    pub const REQ_BE: usize = 7;
    pub const CPL_STATUS_BC: usize = 6;
    pub const CPL_BC_LO: usize = 7;
    /// Completions: requester ID; configuration requests: completer (target) ID.
    pub const ID2: core::ops::Range<usize> = 8..10;
    pub const CPL_TAG: usize = 10;
    pub const CPL_LOWER_ADDR: usize = 11;
    pub const CFG_EXT_REG: usize = 10;
    pub const CFG_REG: usize = 11;
    pub const ADDR_HI: core::ops::Range<usize> = 8..12;
    pub const ADDR32: core::ops::Range<usize> = 8..12;
    pub const ADDR64_LO: core::ops::Range<usize> = 12..16;
}

/// Header length of a TLP with a 3 DW header.
pub const HEADER_LEN_3DW: usize = 12;
/// Header length of a TLP with a 4 DW header.
pub const HEADER_LEN_4DW: usize = 16;
/// Length of the TLP digest (ECRC) present when TD is set.
pub const DIGEST_LEN: usize = 4;
/// Largest payload a TLP can carry (Length 0 encodes 1024 DW).
pub const MAX_PAYLOAD_LEN: usize = 4096;

/// The TLP types the spec defines for Fmt 000b..011b (section 2.2.1, table 2-3), by their
/// Fmt/Type encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TlpType {
    /// Memory read request (MRd), 3 or 4 DW header.
    MemRead,
    /// Locked memory read request (MRdLk).
    MemReadLocked,
    /// Memory write request (MWr), 3 or 4 DW header.
    MemWrite,
    /// I/O read request.
    IoRead,
    /// I/O write request.
    IoWrite,
    /// Configuration read, type 0.
    CfgRead0,
    /// Configuration write, type 0.
    CfgWrite0,
    /// Configuration read, type 1.
    CfgRead1,
    /// Configuration write, type 1.
    CfgWrite1,
    /// Message request without data (routing in the low type bits).
    Msg,
    /// Message request with data.
    MsgData,
    /// Completion without data.
    Cpl,
    /// Completion with data.
    CplData,
    /// Completion for a locked read, without data.
    CplLocked,
    /// Completion for a locked read, with data.
    CplDataLocked,
    /// AtomicOp FetchAdd request.
    FetchAdd,
    /// AtomicOp Swap request.
    Swap,
    /// AtomicOp CAS request.
    Cas,
}

impl TlpType {
    /// Classifies a Fmt (3 bits) / Type (5 bits) pair; `None` when the spec defines no TLP for it
    /// (TLP prefixes included).
    pub fn from_fmt_type(fmt: u8, ty: u8) -> Option<TlpType> {
        use TlpType::*;
        let t = match (fmt, ty) {
            (0 | 1, 0b00000) => MemRead,
            (0 | 1, 0b00001) => MemReadLocked,
            (2 | 3, 0b00000) => MemWrite,
            (0, 0b00010) => IoRead,
            (2, 0b00010) => IoWrite,
            (0, 0b00100) => CfgRead0,
            (2, 0b00100) => CfgWrite0,
            (0, 0b00101) => CfgRead1,
            (2, 0b00101) => CfgWrite1,
            (1, 0b10000..=0b10111) => Msg,
            (3, 0b10000..=0b10111) => MsgData,
            (0, 0b01010) => Cpl,
            (2, 0b01010) => CplData,
            (0, 0b01011) => CplLocked,
            (2, 0b01011) => CplDataLocked,
            (2 | 3, 0b01100) => FetchAdd,
            (2 | 3, 0b01101) => Swap,
            (2 | 3, 0b01110) => Cas,
            _ => return None,
        };
        Some(t)
    }

    /// Whether this is a completion (the header carries completer ID, status and byte count).
    pub const fn is_completion(self) -> bool {
        matches!(self, TlpType::Cpl | TlpType::CplData | TlpType::CplLocked | TlpType::CplDataLocked)
    }

    /// Whether this is a configuration request (the header carries a target ID and register).
    pub const fn is_config(self) -> bool {
        matches!(self, TlpType::CfgRead0 | TlpType::CfgWrite0 | TlpType::CfgRead1 | TlpType::CfgWrite1)
    }

    /// Whether a requester expects a completion for this TLP (non-posted request).
    pub const fn is_non_posted(self) -> bool {
        !matches!(self, TlpType::MemWrite | TlpType::Msg | TlpType::MsgData) && !self.is_completion()
    }
}

/// A view of a TLP in a buffer.
#[derive(Debug, Clone)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps a buffer without checking it. Accessors panic if the buffer is shorter than the
    /// header (or the payload they touch) declares; use [`Packet::new_checked`] for untrusted bytes.
    pub const fn new_unchecked(buffer: T) -> Self {
        Packet { buffer }
    }

    /// Wraps a buffer after checking the Fmt/Type pair and that the buffer holds the whole
    /// header, payload and digest the TLP declares.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Packet { buffer };
        p.check_len()?;
        Ok(p)
    }

    /// The checks [`Packet::new_checked`] makes.
    pub fn check_len(&self) -> Result<()> {
        let have = self.buffer.as_ref().len();
        if have < 4 {
            return Err(Error::Truncated { need: 4, have });
        }
        if self.tlp_type().is_none() {
            return Err(Error::Malformed { what: "TLP Fmt/Type combination" });
        }
        let need = self.total_len();
        if have < need {
            return Err(Error::Truncated { need, have });
        }
        Ok(())
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn b(&self, i: usize) -> u8 {
        self.buffer.as_ref()[i]
    }

    fn u16_at(&self, r: core::ops::Range<usize>) -> u16 {
        let b = &self.buffer.as_ref()[r];
        u16::from_be_bytes([b[0], b[1]])
    }

    fn u32_at(&self, r: core::ops::Range<usize>) -> u32 {
        let b = &self.buffer.as_ref()[r];
        u32::from_be_bytes([b[0], b[1], b[2], b[3]])
    }

    /// The raw Fmt field (3 bits).
    pub fn fmt(&self) -> u8 {
        self.b(field::FMT_TYPE) >> 5
    }

    /// The raw Type field (5 bits).
    pub fn raw_type(&self) -> u8 {
        self.b(field::FMT_TYPE) & 0x1f
    }

    /// The TLP type, `None` for a combination the spec does not define.
    pub fn tlp_type(&self) -> Option<TlpType> {
        TlpType::from_fmt_type(self.fmt(), self.raw_type())
    }

    /// Whether the header is 4 DW (Fmt bit 0).
    pub fn is_4dw(&self) -> bool {
        self.fmt() & 1 != 0
    }

    /// Whether the TLP carries a data payload (Fmt bit 1).
    pub fn has_data(&self) -> bool {
        self.fmt() & 2 != 0
    }

    /// Header length in bytes (12 or 16).
    pub fn header_len(&self) -> usize {
        if self.is_4dw() {
            HEADER_LEN_4DW
        } else {
            HEADER_LEN_3DW
        }
    }

    /// Traffic class (0-7).
    pub fn tc(&self) -> u8 {
        (self.b(field::FLAGS1) >> 4) & 7
    }

    /// Attributes as bits: 1 = No Snoop, 2 = Relaxed Ordering, 4 = ID-Based Ordering.
    pub fn attr(&self) -> u8 {
        ((self.b(field::FLAGS1) >> 2) & 1) << 2 | (self.b(field::FLAGS2) >> 4) & 3
    }

    /// Lightweight notification.
    pub fn ln(&self) -> bool {
        self.b(field::FLAGS1) & 0x02 != 0
    }

    /// TLP processing hints present.
    pub fn th(&self) -> bool {
        self.b(field::FLAGS1) & 0x01 != 0
    }

    /// TLP digest (ECRC) present.
    pub fn td(&self) -> bool {
        self.b(field::FLAGS2) & 0x80 != 0
    }

    /// Poisoned data.
    pub fn ep(&self) -> bool {
        self.b(field::FLAGS2) & 0x40 != 0
    }

    /// Address type (2 bits).
    pub fn at(&self) -> u8 {
        (self.b(field::FLAGS2) >> 2) & 3
    }

    /// The raw 10-bit Length field (0 encodes 1024 where a length is meaningful).
    pub fn length_field(&self) -> u16 {
        u16::from(self.b(field::FLAGS2) & 3) << 8 | u16::from(self.b(field::LENGTH_LO))
    }

    /// Payload length in bytes: the decoded Length in DWs times 4 when the TLP has data, else 0.
    pub fn payload_len(&self) -> usize {
        if !self.has_data() {
            return 0;
        }
        match self.length_field() {
            0 => MAX_PAYLOAD_LEN,
            n => usize::from(n) * 4,
        }
    }

    /// Header + payload + digest, in bytes.
    pub fn total_len(&self) -> usize {
        self.header_len() + self.payload_len() + if self.td() { DIGEST_LEN } else { 0 }
    }

    /// Tag bits 9 and 8 (DW0 bits 23 and 19), as the high bits of a 10-bit tag.
    fn tag_hi(&self) -> u16 {
        let f = self.b(field::FLAGS1);
        u16::from(f >> 7) << 9 | u16::from((f >> 3) & 1) << 8
    }

    /// Requests: the requester ID (bus << 8 | device << 3 | function).
    pub fn requester_id(&self) -> u16 {
        self.u16_at(field::ID1)
    }

    /// Requests: the 10-bit tag.
    pub fn tag(&self) -> u16 {
        self.tag_hi() | u16::from(self.b(field::REQ_TAG))
    }

    /// Requests: last DW byte enables.
    pub fn last_be(&self) -> u8 {
        self.b(field::REQ_BE) >> 4
    }

    /// Requests: first DW byte enables.
    pub fn first_be(&self) -> u8 {
        self.b(field::REQ_BE) & 0x0f
    }

    /// Memory and I/O requests: the DW-aligned address (bits 1:0 clear).
    pub fn address(&self) -> u64 {
        if self.is_4dw() {
            u64::from(self.u32_at(field::ADDR_HI)) << 32 | u64::from(self.u32_at(field::ADDR64_LO) & !3)
        } else {
            u64::from(self.u32_at(field::ADDR32) & !3)
        }
    }

    /// Memory requests: the processing hint (address bits 1:0, meaningful when TH is set).
    pub fn ph(&self) -> u8 {
        let last = if self.is_4dw() { field::ADDR64_LO.end } else { field::ADDR32.end };
        self.b(last - 1) & 3
    }

    /// Configuration requests: the completer (target) ID.
    pub fn cfg_completer_id(&self) -> u16 {
        self.u16_at(field::ID2)
    }

    /// Configuration requests: byte offset of the addressed DW (extended register number and
    /// register number, 0..=0xffc).
    pub fn cfg_register(&self) -> u16 {
        u16::from(self.b(field::CFG_EXT_REG) & 0x0f) << 8 | u16::from(self.b(field::CFG_REG) & 0xfc)
    }

    /// Completions: the completer ID.
    pub fn cpl_completer_id(&self) -> u16 {
        self.u16_at(field::ID1)
    }

    /// Completions: the raw completion status (3 bits).
    pub fn cpl_status(&self) -> u8 {
        self.b(field::CPL_STATUS_BC) >> 5
    }

    /// Completions: byte count modified.
    pub fn cpl_bcm(&self) -> bool {
        self.b(field::CPL_STATUS_BC) & 0x10 != 0
    }

    /// Completions: the raw 12-bit Byte Count field (0 encodes 4096).
    pub fn cpl_byte_count_field(&self) -> u16 {
        u16::from(self.b(field::CPL_STATUS_BC) & 0x0f) << 8 | u16::from(self.b(field::CPL_BC_LO))
    }

    /// Completions: the requester ID.
    pub fn cpl_requester_id(&self) -> u16 {
        self.u16_at(field::ID2)
    }

    /// Completions: the 10-bit tag.
    pub fn cpl_tag(&self) -> u16 {
        self.tag_hi() | u16::from(self.b(field::CPL_TAG))
    }

    /// Completions: lower address (7 bits).
    pub fn cpl_lower_address(&self) -> u8 {
        self.b(field::CPL_LOWER_ADDR) & 0x7f
    }

    /// The data payload ([`Packet::payload_len`] bytes after the header).
    pub fn payload(&self) -> &[u8] {
        let h = self.header_len();
        &self.buffer.as_ref()[h..h + self.payload_len()]
    }

    /// The TLP digest (ECRC) when TD is set.
    pub fn digest(&self) -> Option<u32> {
        if !self.td() {
            return None;
        }
        let s = self.header_len() + self.payload_len();
        Some(self.u32_at(s..s + DIGEST_LEN))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn b_mut(&mut self, i: usize) -> &mut u8 {
        &mut self.buffer.as_mut()[i]
    }

    fn set_bits(&mut self, i: usize, mask: u8, value: u8) {
        let b = self.b_mut(i);
        *b = (*b & !mask) | (value & mask);
    }

    /// Sets Fmt (3 bits) and Type (5 bits).
    pub fn set_fmt_type(&mut self, fmt: u8, ty: u8) {
        *self.b_mut(field::FMT_TYPE) = (fmt & 7) << 5 | (ty & 0x1f);
    }

    /// Sets the traffic class.
    pub fn set_tc(&mut self, tc: u8) {
        self.set_bits(field::FLAGS1, 0x70, tc << 4);
    }

    /// Sets the attribute bits (1 = NS, 2 = RO, 4 = IDO).
    pub fn set_attr(&mut self, attr: u8) {
        self.set_bits(field::FLAGS1, 0x04, (attr >> 2) << 2);
        self.set_bits(field::FLAGS2, 0x30, attr << 4);
    }

    /// Sets LN.
    pub fn set_ln(&mut self, v: bool) {
        self.set_bits(field::FLAGS1, 0x02, u8::from(v) << 1);
    }

    /// Sets TH.
    pub fn set_th(&mut self, v: bool) {
        self.set_bits(field::FLAGS1, 0x01, u8::from(v));
    }

    /// Sets TD (the caller also writes the digest with [`Packet::set_digest`]).
    pub fn set_td(&mut self, v: bool) {
        self.set_bits(field::FLAGS2, 0x80, u8::from(v) << 7);
    }

    /// Sets EP.
    pub fn set_ep(&mut self, v: bool) {
        self.set_bits(field::FLAGS2, 0x40, u8::from(v) << 6);
    }

    /// Sets the address type.
    pub fn set_at(&mut self, at: u8) {
        self.set_bits(field::FLAGS2, 0x0c, at << 2);
    }

    /// Sets the raw 10-bit Length field.
    pub fn set_length_field(&mut self, len: u16) {
        self.set_bits(field::FLAGS2, 0x03, (len >> 8) as u8);
        *self.b_mut(field::LENGTH_LO) = len as u8;
    }

    fn set_tag_hi(&mut self, tag: u16) {
        self.set_bits(field::FLAGS1, 0x80, ((tag >> 9) as u8 & 1) << 7);
        self.set_bits(field::FLAGS1, 0x08, ((tag >> 8) as u8 & 1) << 3);
    }

    fn set_u16(&mut self, r: core::ops::Range<usize>, v: u16) {
        self.buffer.as_mut()[r].copy_from_slice(&v.to_be_bytes());
    }

    fn set_u32(&mut self, r: core::ops::Range<usize>, v: u32) {
        self.buffer.as_mut()[r].copy_from_slice(&v.to_be_bytes());
    }

    /// Requests: sets the requester ID.
    pub fn set_requester_id(&mut self, id: u16) {
        self.set_u16(field::ID1, id);
    }

    /// Requests: sets the 10-bit tag.
    pub fn set_tag(&mut self, tag: u16) {
        self.set_tag_hi(tag);
        *self.b_mut(field::REQ_TAG) = tag as u8;
    }

    /// Requests: sets the byte enables.
    pub fn set_byte_enables(&mut self, first_be: u8, last_be: u8) {
        *self.b_mut(field::REQ_BE) = (last_be & 0xf) << 4 | (first_be & 0xf);
    }

    /// Memory and I/O requests: sets the address (bits 1:0 ignored) and the processing hint. The
    /// header format (3 or 4 DW) must already be set.
    pub fn set_address(&mut self, address: u64, ph: u8) {
        let lo = (address as u32 & !3) | u32::from(ph & 3);
        if self.is_4dw() {
            self.set_u32(field::ADDR_HI, (address >> 32) as u32);
            self.set_u32(field::ADDR64_LO, lo);
        } else {
            self.set_u32(field::ADDR32, lo);
        }
    }

    /// Configuration requests: sets the completer (target) ID and the register byte offset.
    pub fn set_cfg_target(&mut self, completer_id: u16, register: u16) {
        self.set_u16(field::ID2, completer_id);
        *self.b_mut(field::CFG_EXT_REG) = (register >> 8) as u8 & 0x0f;
        *self.b_mut(field::CFG_REG) = register as u8 & 0xfc;
    }

    /// Completions: sets completer ID, status, BCM and the raw Byte Count field.
    pub fn set_cpl_fields(&mut self, completer_id: u16, status: u8, bcm: bool, byte_count_field: u16) {
        self.set_u16(field::ID1, completer_id);
        *self.b_mut(field::CPL_STATUS_BC) =
            (status & 7) << 5 | u8::from(bcm) << 4 | (byte_count_field >> 8) as u8 & 0x0f;
        *self.b_mut(field::CPL_BC_LO) = byte_count_field as u8;
    }

    /// Completions: sets requester ID, the 10-bit tag and the lower address.
    pub fn set_cpl_requester(&mut self, requester_id: u16, tag: u16, lower_address: u8) {
        self.set_tag_hi(tag);
        self.set_u16(field::ID2, requester_id);
        *self.b_mut(field::CPL_TAG) = tag as u8;
        *self.b_mut(field::CPL_LOWER_ADDR) = lower_address & 0x7f;
    }

    /// The data payload, writable (Fmt and Length must already be set).
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let h = self.header_len();
        let n = self.payload_len();
        &mut self.buffer.as_mut()[h..h + n]
    }

    /// Writes the digest after the payload (TD, Fmt and Length must already be set).
    pub fn set_digest(&mut self, ecrc: u32) {
        let s = self.header_len() + self.payload_len();
        self.set_u32(s..s + DIGEST_LEN, ecrc);
    }
}

/// The fuzz target's body for the view alone: every accessor of a checked packet on arbitrary
/// bytes. Panics only if a checked view panics.
#[cfg(any(test, fuzzing))]
pub fn fuzz_view(data: &[u8]) {
    if let Ok(p) = Packet::new_checked(data) {
        let _ = (p.fmt(), p.raw_type(), p.tc(), p.attr(), p.ln(), p.th(), p.td(), p.ep(), p.at());
        let _ = (p.length_field(), p.requester_id(), p.tag(), p.first_be(), p.last_be());
        let _ = (p.cfg_completer_id(), p.cfg_register(), p.cpl_completer_id(), p.cpl_status());
        let _ = (p.cpl_bcm(), p.cpl_byte_count_field(), p.cpl_requester_id(), p.cpl_tag());
        let _ = (p.cpl_lower_address(), p.payload(), p.digest(), p.tlp_type());
        let _ = (p.address(), p.ph());
        assert!(p.total_len() <= data.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // CplD: TC 2, attr 7, tag 451, completer ca:14.6, byte count 3392, requester e6:0e.0,
    // lower address 15, 4 DW of data.
    static CPLD: [u8; 28] = [
        0x4a, 0x2c, 0x30, 0x04, 0xca, 0xa6, 0x0d, 0x40, 0xe6, 0x70, 0xc3, 0x0f, 0x6c, 0x18, 0x9c, 0x24, 0x27,
        0x9e, 0x98, 0x51, 0xd5, 0x81, 0x42, 0x04, 0x13, 0x6f, 0xeb, 0x57,
    ];
    // MRd64 with TH, PH 2, tag 71, requester 17:0c.5, BEs e/e, 32 DW.
    static MRD64: [u8; 16] =
        [0x20, 0x25, 0x10, 0x20, 0x17, 0x65, 0x47, 0xee, 0x3d, 0x99, 0x06, 0x2a, 0xbc, 0x41, 0x9e, 0xf2];

    #[test]
    fn deconstruct_cpld() {
        let p = Packet::new_checked(&CPLD[..]).unwrap();
        assert_eq!(p.tlp_type(), Some(TlpType::CplData));
        assert_eq!((p.tc(), p.attr(), p.td(), p.ep()), (2, 7, false, false));
        assert_eq!(p.length_field(), 4);
        assert_eq!(p.cpl_completer_id(), 0xcaa6);
        assert_eq!((p.cpl_status(), p.cpl_bcm(), p.cpl_byte_count_field()), (0, false, 3392));
        assert_eq!((p.cpl_requester_id(), p.cpl_tag(), p.cpl_lower_address()), (0xe670, 451, 15));
        assert_eq!(p.payload(), &CPLD[12..]);
        assert_eq!(p.total_len(), 28);
    }

    #[test]
    fn deconstruct_mrd64() {
        let p = Packet::new_checked(&MRD64[..]).unwrap();
        assert_eq!(p.tlp_type(), Some(TlpType::MemRead));
        assert!(p.is_4dw() && !p.has_data() && p.th());
        assert_eq!((p.tag(), p.requester_id(), p.first_be(), p.last_be()), (71, 0x1765, 0xe, 0xe));
        assert_eq!((p.address(), p.ph()), (4438585688367144688, 2));
        assert_eq!((p.tc(), p.attr(), p.length_field()), (2, 5, 32));
    }

    #[test]
    fn construct() {
        let mut buf = [0u8; 28];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_fmt_type(2, 0b01010);
        p.set_tc(2);
        p.set_attr(7);
        p.set_length_field(4);
        p.set_cpl_fields(0xcaa6, 0, false, 3392);
        p.set_cpl_requester(0xe670, 451, 15);
        p.payload_mut().copy_from_slice(&CPLD[12..]);
        assert_eq!(buf, CPLD);
        let mut buf = [0u8; 16];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_fmt_type(1, 0);
        p.set_tc(2);
        p.set_attr(5);
        p.set_th(true);
        p.set_length_field(32);
        p.set_requester_id(0x1765);
        p.set_tag(71);
        p.set_byte_enables(0xe, 0xe);
        p.set_address(4438585688367144688, 2);
        assert_eq!(buf, MRD64);
    }

    #[test]
    fn rejects() {
        assert_eq!(Packet::new_checked(&CPLD[..27]).unwrap_err(), Error::Truncated { need: 28, have: 27 });
        assert_eq!(Packet::new_checked(&MRD64[..15]).unwrap_err(), Error::Truncated { need: 16, have: 15 });
        assert!(Packet::new_checked(&CPLD[..3]).is_err());
        // Fmt 100b (prefix) and an undefined type.
        assert!(Packet::new_checked(&[0x80u8; 16][..]).is_err());
        assert!(Packet::new_checked(&[0x03u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0][..]).is_err());
        // I/O with a 4 DW header is not defined.
        assert!(Packet::new_checked(&[0x22u8, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0][..]).is_err());
        // Length 0 with data means 1024 DW.
        let mut big = vec![0u8; 12 + 4096];
        big[0] = 0x40;
        assert_eq!(Packet::new_checked(&big[..]).unwrap().payload_len(), 4096);
        assert!(Packet::new_checked(&big[..12 + 4095]).is_err());
    }

    #[test]
    fn digest() {
        let mut buf = [0u8; 16];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_fmt_type(0, 0);
        p.set_length_field(1);
        p.set_td(true);
        p.set_digest(0xdeadbeef);
        let p = Packet::new_checked(&buf[..]).unwrap();
        assert_eq!(p.digest(), Some(0xdeadbeef));
        assert!(Packet::new_checked(&buf[..15]).is_err());
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            fuzz_view(&bytes);
        }
    }
}
