//! The TLP representation: parse from a [`Packet`] view, emit into one.
//!
//! Layer: pcie engine, above the wire view. Implements PCI Express Base Specification 2.2
//! (transaction layer packet formats) for memory (32/64-bit address), I/O and configuration
//! (type 0/1) requests and completions with and without data, with 10-bit tags (2.2.6.2),
//! TLP processing hints (2.2.7.1) and completion byte count/lower address (2.2.9).
//!
//! Invariants: [`Tlp::decode`] never panics on any bytes; a decoded TLP re-encodes to a TLP that
//! decodes equal (reserved bits are dropped). Fields are kept as the link carries them: `address`
//! is DW-aligned, byte enables are raw nibbles, a completion's `byte_count` is 1..=4096 (the wire's
//! 0 is 4096). Configuration and I/O requests must have Length 1 (they are malformed otherwise).

use core::fmt;
use core::str::FromStr;

use lanbus_wire::tlp::{Packet, DIGEST_LEN, HEADER_LEN_3DW, HEADER_LEN_4DW};

use crate::{Error, Result};

/// A PCI requester/completer ID: bus (8 bits), device (5 bits), function (3 bits). Written
/// `bb:dd.f` in hexadecimal.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Bdf(pub u16);

impl Bdf {
    /// The ID of `bus:device.function`; `None` if device > 31 or function > 7.
    pub const fn new(bus: u8, device: u8, function: u8) -> Option<Bdf> {
        if device > 31 || function > 7 {
            return None;
        }
        Some(Bdf((bus as u16) << 8 | (device as u16) << 3 | function as u16))
    }

    /// Bus number.
    pub const fn bus(self) -> u8 {
        (self.0 >> 8) as u8
    }

    /// Device number (0-31).
    pub const fn device(self) -> u8 {
        (self.0 >> 3) as u8 & 0x1f
    }

    /// Function number (0-7).
    pub const fn function(self) -> u8 {
        self.0 as u8 & 7
    }
}

impl fmt::Display for Bdf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:02x}:{:02x}.{:x}", self.bus(), self.device(), self.function())
    }
}

impl fmt::Debug for Bdf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Bdf {
    type Err = Error;

    /// Parses `bb:dd.f` (hexadecimal; one or two digits for bus and device).
    fn from_str(s: &str) -> Result<Bdf> {
        let bad = || Error::BadId(format!("{s:?} (want bb:dd.f, hexadecimal)"));
        let (bus, rest) = s.split_once(':').ok_or_else(bad)?;
        let (dev, func) = rest.split_once('.').ok_or_else(bad)?;
        let hex = |t: &str, max: u8| -> Result<u8> {
            if t.is_empty() || t.len() > 2 {
                return Err(bad());
            }
            let v = u8::from_str_radix(t, 16).map_err(|_| bad())?;
            if v > max {
                return Err(bad());
            }
            Ok(v)
        };
        if func.len() != 1 {
            return Err(bad());
        }
        Bdf::new(hex(bus, 0xff)?, hex(dev, 31)?, hex(func, 7)?).ok_or_else(bad)
    }
}

/// A 10-bit transaction tag (0..=1023).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Tag(u16);

impl Tag {
    /// Number of distinct 10-bit tags.
    pub const COUNT: u16 = 1024;

    /// The tag `v`; `None` above 1023.
    pub const fn new(v: u16) -> Option<Tag> {
        if v < Self::COUNT {
            Some(Tag(v))
        } else {
            None
        }
    }

    /// The tag's value.
    pub const fn get(self) -> u16 {
        self.0
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// TLP attributes: bit 0 No Snoop, bit 1 Relaxed Ordering, bit 2 ID-Based Ordering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Attr(pub u8);

impl Attr {
    /// No Snoop.
    pub const NO_SNOOP: u8 = 1;
    /// Relaxed Ordering.
    pub const RELAXED_ORDERING: u8 = 2;
    /// ID-Based Ordering.
    pub const ID_BASED_ORDERING: u8 = 4;

    /// Whether No Snoop is set.
    pub const fn no_snoop(self) -> bool {
        self.0 & Self::NO_SNOOP != 0
    }

    /// Whether Relaxed Ordering is set.
    pub const fn relaxed_ordering(self) -> bool {
        self.0 & Self::RELAXED_ORDERING != 0
    }

    /// Whether ID-Based Ordering is set.
    pub const fn id_based_ordering(self) -> bool {
        self.0 & Self::ID_BASED_ORDERING != 0
    }
}

/// Completion status (PCIe 2.2.9, table 2-34).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CplStatus {
    /// Successful Completion (000b).
    Success,
    /// Unsupported Request (001b).
    UnsupportedRequest,
    /// Configuration Request Retry Status (010b).
    ConfigRetry,
    /// Completer Abort (100b).
    CompleterAbort,
    /// A reserved code.
    Unknown(u8),
}

impl From<u8> for CplStatus {
    fn from(v: u8) -> Self {
        match v & 7 {
            0 => CplStatus::Success,
            1 => CplStatus::UnsupportedRequest,
            2 => CplStatus::ConfigRetry,
            4 => CplStatus::CompleterAbort,
            other => CplStatus::Unknown(other),
        }
    }
}

impl From<CplStatus> for u8 {
    fn from(s: CplStatus) -> u8 {
        match s {
            CplStatus::Success => 0,
            CplStatus::UnsupportedRequest => 1,
            CplStatus::ConfigRetry => 2,
            CplStatus::CompleterAbort => 4,
            CplStatus::Unknown(v) => v & 7,
        }
    }
}

impl fmt::Display for CplStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CplStatus::Success => f.write_str("SC"),
            CplStatus::UnsupportedRequest => f.write_str("UR"),
            CplStatus::ConfigRetry => f.write_str("CRS"),
            CplStatus::CompleterAbort => f.write_str("CA"),
            CplStatus::Unknown(v) => write!(f, "reserved ({v:#05b})"),
        }
    }
}

/// The kinds of TLP this codec models, named as in the vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TlpKind {
    /// Memory read, 32-bit address (3 DW header).
    MRd32,
    /// Memory read, 64-bit address (4 DW header).
    MRd64,
    /// Memory write, 32-bit address.
    MWr32,
    /// Memory write, 64-bit address.
    MWr64,
    /// I/O read.
    IORd,
    /// I/O write.
    IOWr,
    /// Configuration read, type 0.
    CfgRd0,
    /// Configuration write, type 0.
    CfgWr0,
    /// Configuration read, type 1.
    CfgRd1,
    /// Configuration write, type 1.
    CfgWr1,
    /// Completion without data.
    Cpl,
    /// Completion with data.
    CplD,
}

impl TlpKind {
    /// Every kind.
    pub const ALL: [TlpKind; 12] = [
        TlpKind::MRd32,
        TlpKind::MRd64,
        TlpKind::MWr32,
        TlpKind::MWr64,
        TlpKind::IORd,
        TlpKind::IOWr,
        TlpKind::CfgRd0,
        TlpKind::CfgWr0,
        TlpKind::CfgRd1,
        TlpKind::CfgWr1,
        TlpKind::Cpl,
        TlpKind::CplD,
    ];

    /// The raw Fmt and Type fields.
    pub const fn fmt_type(self) -> (u8, u8) {
        match self {
            TlpKind::MRd32 => (0, 0),
            TlpKind::MRd64 => (1, 0),
            TlpKind::MWr32 => (2, 0),
            TlpKind::MWr64 => (3, 0),
            TlpKind::IORd => (0, 2),
            TlpKind::IOWr => (2, 2),
            TlpKind::CfgRd0 => (0, 4),
            TlpKind::CfgWr0 => (2, 4),
            TlpKind::CfgRd1 => (0, 5),
            TlpKind::CfgWr1 => (2, 5),
            TlpKind::Cpl => (0, 10),
            TlpKind::CplD => (2, 10),
        }
    }

    /// The kind with these raw Fmt/Type fields, if modelled.
    pub fn from_fmt_type(fmt: u8, ty: u8) -> Option<TlpKind> {
        Self::ALL.into_iter().find(|k| k.fmt_type() == (fmt, ty))
    }

    /// The name used in the vectors and on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            TlpKind::MRd32 => "MRd32",
            TlpKind::MRd64 => "MRd64",
            TlpKind::MWr32 => "MWr32",
            TlpKind::MWr64 => "MWr64",
            TlpKind::IORd => "IORd",
            TlpKind::IOWr => "IOWr",
            TlpKind::CfgRd0 => "CfgRd0",
            TlpKind::CfgWr0 => "CfgWr0",
            TlpKind::CfgRd1 => "CfgRd1",
            TlpKind::CfgWr1 => "CfgWr1",
            TlpKind::Cpl => "Cpl",
            TlpKind::CplD => "CplD",
        }
    }

    /// The kind named `s` (as [`TlpKind::name`]).
    pub fn from_name(s: &str) -> Option<TlpKind> {
        Self::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Whether the TLP carries data.
    pub const fn has_data(self) -> bool {
        self.fmt_type().0 & 2 != 0
    }

    /// Whether the header is 4 DW.
    pub const fn is_4dw(self) -> bool {
        self.fmt_type().0 & 1 != 0
    }

    /// Whether this is a completion.
    pub const fn is_completion(self) -> bool {
        matches!(self, TlpKind::Cpl | TlpKind::CplD)
    }

    /// Whether this is a configuration request.
    pub const fn is_config(self) -> bool {
        matches!(self, TlpKind::CfgRd0 | TlpKind::CfgWr0 | TlpKind::CfgRd1 | TlpKind::CfgWr1)
    }

    /// Whether this is a memory or I/O request (the header carries an address).
    pub const fn has_address(self) -> bool {
        !self.is_completion() && !self.is_config()
    }

    /// Whether the requester waits for a completion.
    pub const fn is_non_posted(self) -> bool {
        !matches!(self, TlpKind::MWr32 | TlpKind::MWr64) && !self.is_completion()
    }
}

impl fmt::Display for TlpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Header fields of a memory or I/O request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct MemHeader {
    /// Requester ID.
    pub requester_id: Bdf,
    /// First DW byte enables (4 bits).
    pub first_be: u8,
    /// Last DW byte enables (4 bits; 0 for a 1 DW request).
    pub last_be: u8,
    /// DW-aligned address (bits 1:0 zero; below 2^32 for 32-bit and I/O kinds).
    pub address: u64,
    /// Processing hint (2 bits; in address bits 1:0 on the wire, meaningful with TH).
    pub ph: u8,
}

/// Header fields of a configuration request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ConfigHeader {
    /// Requester ID.
    pub requester_id: Bdf,
    /// First DW byte enables.
    pub first_be: u8,
    /// Last DW byte enables (must be 0).
    pub last_be: u8,
    /// The target function.
    pub completer_id: Bdf,
    /// Byte offset of the DW addressed (0..=0xffc, DW-aligned).
    pub register: u16,
}

/// Header fields of a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CompletionHeader {
    /// Completer ID.
    pub completer_id: Bdf,
    /// Completion status.
    pub status: CplStatus,
    /// Byte Count Modified (PCI-X completers only).
    pub bcm: bool,
    /// Bytes left to return for the request, this completion included (1..=4096).
    pub byte_count: u16,
    /// Requester ID.
    pub requester_id: Bdf,
    /// Low 7 bits of the byte address of the first byte returned.
    pub lower_address: u8,
}

/// The kind-specific part of a TLP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Header {
    /// MRd32/64, MWr32/64, IORd, IOWr.
    Mem(MemHeader),
    /// CfgRd0/1, CfgWr0/1.
    Config(ConfigHeader),
    /// Cpl, CplD.
    Completion(CompletionHeader),
}

/// One TLP: every header field and the payload.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tlp {
    /// Which TLP.
    pub kind: TlpKind,
    /// Traffic class (0-7).
    pub tc: u8,
    /// Attributes.
    pub attr: Attr,
    /// TLP processing hints present.
    pub th: bool,
    /// Poisoned data.
    pub ep: bool,
    /// Address type (2 bits).
    pub at: u8,
    /// Lightweight notification.
    pub ln: bool,
    /// The TLP digest when TD is set (carried, not computed or checked).
    pub ecrc: Option<u32>,
    /// The 10-bit tag.
    pub tag: Tag,
    /// Length in DW: 1..=1024 for requests and CplD (the payload length for data TLPs); the raw
    /// reserved field (0 normally) for Cpl.
    pub length_dw: u16,
    /// Kind-specific fields; the variant must match `kind`.
    pub header: Header,
    /// Payload (`length_dw * 4` bytes for data kinds, empty otherwise).
    pub data: Vec<u8>,
}

impl Tlp {
    fn base(kind: TlpKind, tag: Tag, length_dw: u16, header: Header, data: Vec<u8>) -> Tlp {
        Tlp {
            kind,
            tc: 0,
            attr: Attr(0),
            th: false,
            ep: false,
            at: 0,
            ln: false,
            ecrc: None,
            tag,
            length_dw,
            header,
            data,
        }
    }

    /// A memory read request (MRd32 below 4 GiB, else MRd64) with explicit DW length and byte
    /// enables; see [`crate::request`] for building these from a byte range.
    pub fn mem_read(
        requester_id: Bdf,
        tag: Tag,
        address: u64,
        length_dw: u16,
        first_be: u8,
        last_be: u8,
    ) -> Tlp {
        let kind = if address >> 32 == 0 { TlpKind::MRd32 } else { TlpKind::MRd64 };
        let h = MemHeader { requester_id, first_be, last_be, address, ph: 0 };
        Self::base(kind, tag, length_dw, Header::Mem(h), Vec::new())
    }

    /// A memory write request carrying `data` (a whole number of DWs, the first at `address`).
    pub fn mem_write(requester_id: Bdf, address: u64, first_be: u8, last_be: u8, data: Vec<u8>) -> Tlp {
        let kind = if address >> 32 == 0 { TlpKind::MWr32 } else { TlpKind::MWr64 };
        let h = MemHeader { requester_id, first_be, last_be, address, ph: 0 };
        let len = (data.len() / 4) as u16;
        Self::base(kind, Tag(0), len, Header::Mem(h), data)
    }

    /// A configuration read of the DW at byte offset `register` of `target`.
    pub fn cfg_read(
        type1: bool,
        requester_id: Bdf,
        tag: Tag,
        target: Bdf,
        register: u16,
        first_be: u8,
    ) -> Tlp {
        let kind = if type1 { TlpKind::CfgRd1 } else { TlpKind::CfgRd0 };
        let h = ConfigHeader { requester_id, first_be, last_be: 0, completer_id: target, register };
        Self::base(kind, tag, 1, Header::Config(h), Vec::new())
    }

    /// A configuration write of one DW to byte offset `register` of `target`.
    pub fn cfg_write(
        type1: bool,
        requester_id: Bdf,
        tag: Tag,
        target: Bdf,
        register: u16,
        first_be: u8,
        value: [u8; 4],
    ) -> Tlp {
        let kind = if type1 { TlpKind::CfgWr1 } else { TlpKind::CfgWr0 };
        let h = ConfigHeader { requester_id, first_be, last_be: 0, completer_id: target, register };
        Self::base(kind, tag, 1, Header::Config(h), value.to_vec())
    }

    /// A completion for `requester_id`/`tag`: CplD when `data` is non-empty, else Cpl.
    pub fn completion(
        completer_id: Bdf,
        requester_id: Bdf,
        tag: Tag,
        status: CplStatus,
        byte_count: u16,
        lower_address: u8,
        data: Vec<u8>,
    ) -> Tlp {
        let kind = if data.is_empty() { TlpKind::Cpl } else { TlpKind::CplD };
        let len = (data.len() / 4) as u16;
        let h =
            CompletionHeader { completer_id, status, bcm: false, byte_count, requester_id, lower_address };
        Self::base(kind, tag, len, Header::Completion(h), data)
    }

    /// The requester ID, whatever the kind.
    pub fn requester_id(&self) -> Bdf {
        match &self.header {
            Header::Mem(h) => h.requester_id,
            Header::Config(h) => h.requester_id,
            Header::Completion(h) => h.requester_id,
        }
    }

    /// The byte enables of a request, `None` for completions.
    pub fn byte_enables(&self) -> Option<(u8, u8)> {
        match &self.header {
            Header::Mem(h) => Some((h.first_be, h.last_be)),
            Header::Config(h) => Some((h.first_be, h.last_be)),
            Header::Completion(_) => None,
        }
    }

    /// Parses a checked view. Fails for TLP types this codec does not model and for requests
    /// that break the length rules; never panics.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Tlp> {
        let mut tlp = Self::parse_header(p)?;
        tlp.data = p.payload().to_vec();
        Ok(tlp)
    }

    /// [`parse`](Self::parse) without the payload (`data` is left empty).
    fn parse_header<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Tlp> {
        let (fmt, ty) = (p.fmt(), p.raw_type());
        let Some(kind) = TlpKind::from_fmt_type(fmt, ty) else {
            return match p.tlp_type() {
                Some(_) => Err(Error::Unsupported { fmt, ty }),
                None => Err(lanbus_wire::Error::Malformed { what: "TLP Fmt/Type combination" }.into()),
            };
        };
        let raw_len = p.length_field();
        let length_dw = if kind == TlpKind::Cpl || raw_len != 0 { raw_len } else { 1024 };
        if (kind.is_config() || matches!(kind, TlpKind::IORd | TlpKind::IOWr)) && length_dw != 1 {
            return Err(Error::Malformed("configuration and I/O requests have Length 1"));
        }
        let tag = Tag(if kind.is_completion() { p.cpl_tag() } else { p.tag() });
        let header = if kind.is_completion() {
            let bc = p.cpl_byte_count_field();
            Header::Completion(CompletionHeader {
                completer_id: Bdf(p.cpl_completer_id()),
                status: CplStatus::from(p.cpl_status()),
                bcm: p.cpl_bcm(),
                byte_count: if bc == 0 { 4096 } else { bc },
                requester_id: Bdf(p.cpl_requester_id()),
                lower_address: p.cpl_lower_address(),
            })
        } else if kind.is_config() {
            Header::Config(ConfigHeader {
                requester_id: Bdf(p.requester_id()),
                first_be: p.first_be(),
                last_be: p.last_be(),
                completer_id: Bdf(p.cfg_completer_id()),
                register: p.cfg_register(),
            })
        } else {
            Header::Mem(MemHeader {
                requester_id: Bdf(p.requester_id()),
                first_be: p.first_be(),
                last_be: p.last_be(),
                address: p.address(),
                ph: p.ph(),
            })
        };
        Ok(Tlp {
            kind,
            tc: p.tc(),
            attr: Attr(p.attr()),
            th: p.th(),
            ep: p.ep(),
            at: p.at(),
            ln: p.ln(),
            ecrc: p.digest(),
            tag,
            length_dw,
            header,
            data: Vec::new(),
        })
    }

    /// Decodes exactly one TLP from `bytes` (no bytes may follow it).
    pub fn decode(bytes: &[u8]) -> Result<Tlp> {
        let (mut tlp, payload) = Self::decode_borrowed(bytes)?;
        tlp.data = payload.to_vec();
        Ok(tlp)
    }

    /// [`decode`](Self::decode) without copying the payload: the TLP's `data` is empty and the
    /// payload (`length_dw * 4` bytes for a data kind, none otherwise) is the returned part of
    /// `bytes`. For receive paths that only copy the payload on to its destination.
    pub fn decode_borrowed(bytes: &[u8]) -> Result<(Tlp, &[u8])> {
        let p = Packet::new_checked(bytes)?;
        let tlp = Self::parse_header(&p)?;
        let extra = bytes.len() - p.total_len();
        if extra != 0 {
            return Err(Error::TrailingBytes(extra));
        }
        let (header, len) = (p.header_len(), p.payload_len());
        Ok((tlp, &bytes[header..header + len]))
    }

    /// Checks that the representation can be encoded: field ranges, the header variant against
    /// the kind, the payload against the length.
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Invalid(m));
        if self.tc > 7 || self.attr.0 > 7 || self.at > 3 {
            return bad(format!("tc {} / attr {} / at {} out of range", self.tc, self.attr.0, self.at));
        }
        let want_data = if self.kind.has_data() { usize::from(self.length_dw) * 4 } else { 0 };
        if self.data.len() != want_data {
            return bad(format!(
                "{} with length {} DW has {} data bytes",
                self.kind,
                self.length_dw,
                self.data.len()
            ));
        }
        match (self.kind, &self.header) {
            (TlpKind::Cpl, Header::Completion(h)) | (TlpKind::CplD, Header::Completion(h)) => {
                if self.kind == TlpKind::Cpl && self.length_dw > 1023 {
                    return bad("Cpl length field is 10 bits".into());
                }
                if self.kind == TlpKind::CplD && !(1..=1024).contains(&self.length_dw) {
                    return bad("CplD length must be 1..=1024 DW".into());
                }
                if !(1..=4096).contains(&h.byte_count) || h.lower_address > 0x7f {
                    return bad(format!("byte count {} / lower address {}", h.byte_count, h.lower_address));
                }
                if let CplStatus::Unknown(v) = h.status {
                    if matches!(v, 0 | 1 | 2 | 4) || v > 7 {
                        return bad(format!("status {v} is not a reserved code"));
                    }
                }
            }
            (k, Header::Config(h)) if k.is_config() => {
                if self.length_dw != 1
                    || h.first_be > 15
                    || h.last_be > 15
                    || h.register > 0xffc
                    || h.register & 3 != 0
                {
                    return bad(format!(
                        "config request: length {} / register {:#x}",
                        self.length_dw, h.register
                    ));
                }
            }
            (k, Header::Mem(h)) if k.has_address() => {
                if !(1..=1024).contains(&self.length_dw) || h.first_be > 15 || h.last_be > 15 || h.ph > 3 {
                    return bad(format!("request: length {} DW", self.length_dw));
                }
                if h.address & 3 != 0 {
                    return bad(format!("address {:#x} is not DW-aligned", h.address));
                }
                if !k.is_4dw() && h.address >> 32 != 0 {
                    return bad(format!("{k} address {:#x} needs 64 bits", h.address));
                }
                if matches!(k, TlpKind::IORd | TlpKind::IOWr) && self.length_dw != 1 {
                    return bad("I/O requests have Length 1".into());
                }
            }
            _ => return bad(format!("{} with a {:?} header", self.kind, self.header)),
        }
        if self.tag.0 >= Tag::COUNT {
            return bad("tag above 1023".into());
        }
        Ok(())
    }

    /// Bytes the encoded TLP takes.
    pub fn buffer_len(&self) -> usize {
        let h = if self.kind.is_4dw() { HEADER_LEN_4DW } else { HEADER_LEN_3DW };
        h + self.data.len() + if self.ecrc.is_some() { DIGEST_LEN } else { 0 }
    }

    /// Writes the TLP into the front of `buf` and returns its length.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        self.check()?;
        let n = self.buffer_len();
        if buf.len() < n {
            return Err(Error::Invalid(format!("buffer of {} bytes for a {n}-byte TLP", buf.len())));
        }
        let header = self.emit_header(&mut buf[..n]);
        buf[header..header + self.data.len()].copy_from_slice(&self.data);
        if let Some(ecrc) = self.ecrc {
            Packet::new_unchecked(&mut buf[..n]).set_digest(ecrc);
        }
        Ok(n)
    }

    /// Bytes of this TLP's header (3 or 4 DW).
    pub fn header_len(&self) -> usize {
        if self.kind.is_4dw() {
            HEADER_LEN_4DW
        } else {
            HEADER_LEN_3DW
        }
    }

    /// Writes the header alone into the front of `buf` (at least [`header_len`](Self::header_len)
    /// bytes) and returns its length; `length_dw` is taken as is, whatever `data` holds. For
    /// encoders that place the payload themselves: the caller checked the fields. Panics if `buf` is
    /// shorter than the header.
    pub fn emit_header(&self, buf: &mut [u8]) -> usize {
        let header = self.header_len();
        buf[..header].fill(0);
        let mut p = Packet::new_unchecked(buf);
        let (fmt, ty) = self.kind.fmt_type();
        p.set_fmt_type(fmt, ty);
        p.set_tc(self.tc);
        p.set_attr(self.attr.0);
        p.set_th(self.th);
        p.set_td(self.ecrc.is_some());
        p.set_ep(self.ep);
        p.set_at(self.at);
        p.set_ln(self.ln);
        p.set_length_field(self.length_dw & 0x3ff);
        match &self.header {
            Header::Mem(h) => {
                p.set_requester_id(h.requester_id.0);
                p.set_tag(self.tag.0);
                p.set_byte_enables(h.first_be, h.last_be);
                p.set_address(h.address, h.ph);
            }
            Header::Config(h) => {
                p.set_requester_id(h.requester_id.0);
                p.set_tag(self.tag.0);
                p.set_byte_enables(h.first_be, h.last_be);
                p.set_cfg_target(h.completer_id.0, h.register);
            }
            Header::Completion(h) => {
                p.set_cpl_fields(h.completer_id.0, h.status.into(), h.bcm, h.byte_count & 0xfff);
                p.set_cpl_requester(h.requester_id.0, self.tag.0, h.lower_address);
            }
        }
        header
    }

    /// The encoded TLP.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.buffer_len()];
        self.emit(&mut v)?;
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bdf_text() {
        let b: Bdf = "ad:1f.1".parse().unwrap();
        assert_eq!((b.bus(), b.device(), b.function()), (0xad, 0x1f, 1));
        assert_eq!(b.to_string(), "ad:1f.1");
        assert_eq!(Bdf::new(0, 3, 0).unwrap().to_string(), "00:03.0");
        for bad in ["", "ad:1f", "ad:20.0", "ad:1f.8", "100:00.0", "ad:1f.10", "ad.1f:1", "zz:00.0"] {
            assert!(bad.parse::<Bdf>().is_err(), "{bad}");
        }
        assert!(Bdf::new(0, 32, 0).is_none() && Bdf::new(0, 0, 8).is_none());
    }

    #[test]
    fn status_codes() {
        for v in 0..8u8 {
            assert_eq!(u8::from(CplStatus::from(v)), v);
        }
        assert_eq!(CplStatus::from(1), CplStatus::UnsupportedRequest);
        assert_eq!(CplStatus::from(3), CplStatus::Unknown(3));
    }

    #[test]
    fn builders_roundtrip() {
        let r = Bdf::new(1, 2, 3).unwrap();
        let t = Tag::new(0x3ff).unwrap();
        let tlps = [
            Tlp::mem_read(r, t, 0x1000, 4, 0xf, 0xf),
            Tlp::mem_read(r, t, 0x1_0000_1000, 1, 0, 0),
            Tlp::mem_write(r, 0xfee0_0000, 0xf, 0, vec![1, 2, 3, 4]),
            Tlp::cfg_read(false, r, t, Bdf(0x100), 0x10, 0xf),
            Tlp::cfg_write(true, r, t, Bdf(0x100), 0xffc, 0x3, [9, 8, 7, 6]),
            Tlp::completion(r, r, t, CplStatus::UnsupportedRequest, 4, 0, vec![]),
            Tlp::completion(r, r, t, CplStatus::Success, 4096, 0, vec![0; 4096]),
        ];
        for tlp in tlps {
            let bytes = tlp.encode().unwrap();
            assert_eq!(Tlp::decode(&bytes).unwrap(), tlp);
        }
        assert_eq!(Tlp::mem_read(r, t, 0x1000, 1, 0xf, 0).kind, TlpKind::MRd32);
        assert_eq!(Tlp::mem_read(r, t, 1 << 32, 1, 0xf, 0).kind, TlpKind::MRd64);
    }

    #[test]
    fn check_rejects() {
        let r = Bdf(0);
        let mut t = Tlp::mem_write(r, 0x1000, 0xf, 0, vec![1, 2, 3]);
        assert!(t.encode().is_err());
        t = Tlp::mem_read(r, Tag(0), 0x1002, 1, 0xf, 0);
        assert!(t.encode().is_err());
        t = Tlp::mem_read(r, Tag(0), 0x1000, 0, 0xf, 0);
        assert!(t.encode().is_err());
        t = Tlp::mem_read(r, Tag(0), 0x1000, 1, 0xf, 0);
        t.kind = TlpKind::Cpl;
        assert!(t.encode().is_err());
        t = Tlp::cfg_read(false, r, Tag(0), r, 0x1002, 0xf);
        assert!(t.encode().is_err());
        t = Tlp::completion(r, r, Tag(0), CplStatus::Success, 0, 0, vec![]);
        assert!(t.encode().is_err());
    }

    #[test]
    fn decode_rejects() {
        // A 2 DW configuration read, an unsupported message, trailing bytes.
        let mut cfg = Tlp::cfg_read(false, Bdf(0), Tag(0), Bdf(0), 0, 0xf).encode().unwrap();
        cfg[3] = 2;
        assert_eq!(Tlp::decode(&cfg), Err(Error::Malformed("configuration and I/O requests have Length 1")));
        let msg = [0x30u8, 0, 0, 0, 0, 0, 0, 0x7f, 0, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(Tlp::decode(&msg), Err(Error::Unsupported { fmt: 1, ty: 0x10 }));
        let mut rd = Tlp::mem_read(Bdf(0), Tag(0), 0, 1, 0xf, 0).encode().unwrap();
        rd.push(0);
        assert_eq!(Tlp::decode(&rd), Err(Error::TrailingBytes(1)));
    }

    use proptest::prelude::*;

    /// Any encodable TLP of any modelled kind.
    fn any_tlp() -> impl Strategy<Value = Tlp> {
        let flags = (
            0u8..8,
            0u8..8,
            any::<bool>(),
            any::<bool>(),
            0u8..4,
            any::<bool>(),
            any::<Option<u32>>(),
            0u16..1024,
        );
        let ids = (any::<u16>(), any::<u16>(), 0u8..16, 0u8..16, 0u8..4);
        (
            0usize..12,
            flags,
            ids,
            any::<u64>(),
            1u16..=64,
            0u16..1024,
            1u16..=4096,
            0u8..128,
            0u8..8,
            any::<bool>(),
        )
            .prop_map(
                |(
                    k,
                    (tc, attr, th, ep, at, ln, ecrc, tag),
                    (id1, id2, fbe, lbe, ph),
                    addr,
                    len,
                    reg,
                    bc,
                    la,
                    st,
                    bcm,
                )| {
                    let kind = TlpKind::ALL[k];
                    let length_dw = if kind.is_config() || matches!(kind, TlpKind::IORd | TlpKind::IOWr) {
                        1
                    } else if kind == TlpKind::Cpl {
                        len - 1
                    } else {
                        len
                    };
                    let header = if kind.is_completion() {
                        Header::Completion(CompletionHeader {
                            completer_id: Bdf(id1),
                            status: CplStatus::from(st),
                            bcm,
                            byte_count: bc,
                            requester_id: Bdf(id2),
                            lower_address: la,
                        })
                    } else if kind.is_config() {
                        Header::Config(ConfigHeader {
                            requester_id: Bdf(id1),
                            first_be: fbe,
                            last_be: lbe,
                            completer_id: Bdf(id2),
                            register: reg & 0xffc,
                        })
                    } else {
                        let address = if kind.is_4dw() { addr & !3 } else { addr & 0xffff_fffc };
                        Header::Mem(MemHeader {
                            requester_id: Bdf(id1),
                            first_be: fbe,
                            last_be: lbe,
                            address,
                            ph,
                        })
                    };
                    let data = if kind.has_data() {
                        (0..length_dw as usize * 4).map(|i| i as u8 ^ tc).collect()
                    } else {
                        vec![]
                    };
                    Tlp {
                        kind,
                        tc,
                        attr: Attr(attr),
                        th,
                        ep,
                        at,
                        ln,
                        ecrc,
                        tag: Tag(tag),
                        length_dw,
                        header,
                        data,
                    }
                },
            )
    }

    proptest::proptest! {
        #[test]
        fn repr_emit_parse_roundtrip(tlp in any_tlp()) {
            let bytes = tlp.encode().unwrap();
            prop_assert_eq!(bytes.len(), tlp.buffer_len());
            prop_assert_eq!(Tlp::decode(&bytes).unwrap(), tlp);
        }
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..80)) {
            crate::fuzz_tlp(&bytes);
        }

        // Random headers of every modelled kind: the decoder sees mostly valid TLPs.
        #[test]
        fn random_headers_roundtrip(kind in 0usize..12, hdr in proptest::array::uniform16(any::<u8>()),
                                    len in 1u16..=8) {
            let k = TlpKind::ALL[kind];
            let mut bytes = hdr.to_vec();
            let (fmt, ty) = k.fmt_type();
            bytes[0] = fmt << 5 | ty;
            let l = if k.is_config() || matches!(k, TlpKind::IORd | TlpKind::IOWr) { 1 } else { len };
            bytes[2] &= 0x7c; // TD off, length high bits clear
            bytes[3] = l as u8;
            bytes.truncate(if k.is_4dw() { 16 } else { 12 });
            if k.has_data() {
                bytes.extend((0..l * 4).map(|i| i as u8));
            }
            let tlp = Tlp::decode(&bytes).unwrap();
            proptest::prop_assert_eq!(tlp.kind, k);
            crate::fuzz_tlp(&bytes);
        }
    }
}
