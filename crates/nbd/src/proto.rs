//! NBD wire format: constants, header parsers and emitters, and the per-request checks.
//!
//! Layer: pure functions over bytes, below the server's sockets and threads. Nothing here does
//! I/O, reads a clock or allocates more than the option payload it is given, and nothing panics on
//! bytes from a peer: every parser checks lengths first and answers with a [`ProtocolError`].
//!
//! Spec: the NBD protocol (NetworkBlockDevice/nbd `doc/proto.md`): the fixed newstyle handshake
//! ("Newstyle negotiation", "Option types", "Option reply types", "Information types"), and the
//! transmission phase with simple replies ("Request message", "Simple reply message", "Request
//! types", "Error values"). All integers are big-endian. Structured replies, extended headers,
//! metadata contexts and TLS are not implemented; their options are refused with
//! `NBD_REP_ERR_UNSUP`, which every client must accept.

use core::fmt;

use lanbus_block::DeviceError;

/// `NBDMAGIC`: first 8 bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle magic, also the prefix of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Prefix of every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Prefix of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Prefix of every simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server can omit the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const CLIENT_FLAG_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: the client does not want the 124 zero bytes.
pub const CLIENT_FLAG_NO_ZEROES: u32 = 1 << 1;

/// Transmission flag: the flags field is valid (always set).
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag: the export is read-only.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// Transmission flag: `NBD_CMD_FLUSH` is supported.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag: `NBD_CMD_FLAG_FUA` is supported.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// Transmission flag: the medium is rotational.
pub const TFLAG_ROTATIONAL: u16 = 1 << 4;
/// Transmission flag: `NBD_CMD_TRIM` is supported.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag: `NBD_CMD_WRITE_ZEROES` is supported.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Transmission flag: a flush on one connection covers writes completed on every connection.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// Option: select an export and enter transmission (old style reply, no error possible).
pub const OPT_EXPORT_NAME: u32 = 1;
/// Option: the client gives up.
pub const OPT_ABORT: u32 = 2;
/// Option: list the exports.
pub const OPT_LIST: u32 = 3;
/// Option: upgrade to TLS (refused).
pub const OPT_STARTTLS: u32 = 5;
/// Option: describe an export.
pub const OPT_INFO: u32 = 6;
/// Option: describe an export and enter transmission.
pub const OPT_GO: u32 = 7;
/// Option: structured replies (refused).
pub const OPT_STRUCTURED_REPLY: u32 = 8;

/// Option reply: done.
pub const REP_ACK: u32 = 1;
/// Option reply: one export of a list.
pub const REP_SERVER: u32 = 2;
/// Option reply: one information item.
pub const REP_INFO: u32 = 3;
/// Error bit of option replies.
pub const REP_FLAG_ERROR: u32 = 1 << 31;
/// Option reply: the option is not supported.
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
/// Option reply: the server's policy forbids the option.
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
/// Option reply: the option is malformed.
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
/// Option reply: no such export.
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
/// Option reply: the server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;
/// Option reply: the option or its reply is too large.
pub const REP_ERR_TOO_BIG: u32 = REP_FLAG_ERROR | 9;

/// Information type: size and transmission flags.
pub const INFO_EXPORT: u16 = 0;
/// Information type: the canonical export name.
pub const INFO_NAME: u16 = 1;
/// Information type: a human-readable description.
pub const INFO_DESCRIPTION: u16 = 2;
/// Information type: minimum, preferred and maximum block sizes.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Command flag: force unit access (data durable before the reply).
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag on `WRITE_ZEROES`: do not punch a hole.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// Largest READ or WRITE payload this server accepts (32 MiB, the spec's interoperable maximum).
/// Larger requests are refused with `EINVAL` before any buffer is allocated.
pub const MAX_PAYLOAD_BYTES: u32 = 32 << 20;
/// Largest option payload accepted during the handshake; a larger one disconnects the client.
/// `NBD_OPT_GO` needs at most 4 + 4096 + 2 + 2 * 65535 bytes; 256 KiB is ample.
pub const MAX_OPTION_BYTES: u32 = 256 << 10;
/// Longest export name (the spec's limit for strings).
pub const MAX_NAME_BYTES: usize = 4096;
/// Length of the padding after the `NBD_OPT_EXPORT_NAME` reply unless `NO_ZEROES` was agreed.
pub const EXPORT_NAME_ZERO_PAD: usize = 124;

/// NBD error values carried in simple replies (Linux errno numbers, as the spec fixes them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Errno {
    /// `EPERM` (1): write to a read-only export.
    Perm,
    /// `EIO` (5): the device failed.
    Io,
    /// `ENOMEM` (12): out of memory.
    NoMem,
    /// `EINVAL` (22): bad offset, length, alignment, flag or command.
    Inval,
    /// `ENOSPC` (28): a write beyond the end of the export.
    NoSpc,
    /// `EOVERFLOW` (75): a request too large.
    Overflow,
    /// `ENOTSUP` (95): an operation the device does not support.
    NotSup,
    /// `ESHUTDOWN` (108): the server is shutting down.
    Shutdown,
}

impl Errno {
    /// The value on the wire.
    pub const fn as_u32(self) -> u32 {
        match self {
            Errno::Perm => 1,
            Errno::Io => 5,
            Errno::NoMem => 12,
            Errno::Inval => 22,
            Errno::NoSpc => 28,
            Errno::Overflow => 75,
            Errno::NotSup => 95,
            Errno::Shutdown => 108,
        }
    }

    /// The errno for a wire value; unknown values read as `EINVAL`, as the spec tells clients to.
    pub const fn from_u32(v: u32) -> Errno {
        match v {
            1 => Errno::Perm,
            5 => Errno::Io,
            12 => Errno::NoMem,
            28 => Errno::NoSpc,
            75 => Errno::Overflow,
            95 => Errno::NotSup,
            108 => Errno::Shutdown,
            _ => Errno::Inval,
        }
    }
}

impl Errno {
    /// What the client is told of a device's failure: the errno NBD defines for it, or `EIO`
    /// when none fits (an OS error's own errno where NBD has it).
    pub fn of(e: &DeviceError) -> Errno {
        match e {
            DeviceError::OutOfRange { .. }
            | DeviceError::Misaligned { .. }
            | DeviceError::InvalidArgument(_) => Errno::Inval,
            DeviceError::ReadOnly => Errno::Perm,
            DeviceError::NoSpace => Errno::NoSpc,
            DeviceError::NoMemory(_) => Errno::NoMem,
            DeviceError::Unsupported(_) => Errno::NotSup,
            DeviceError::Io(e) => match e.raw_os_error() {
                Some(28) => Errno::NoSpc,
                Some(1) | Some(30) => Errno::Perm, // EPERM, EROFS
                Some(12) => Errno::NoMem,
                _ => Errno::Io,
            },
            _ => Errno::Io,
        }
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Errno::Perm => "EPERM",
            Errno::Io => "EIO",
            Errno::NoMem => "ENOMEM",
            Errno::Inval => "EINVAL",
            Errno::NoSpc => "ENOSPC",
            Errno::Overflow => "EOVERFLOW",
            Errno::NotSup => "ENOTSUP",
            Errno::Shutdown => "ESHUTDOWN",
        };
        f.write_str(name)
    }
}

/// A peer sent bytes that break the protocol; the connection cannot continue.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// Fewer bytes than the structure needs.
    #[error("truncated {what}: need {need} bytes, have {have}")]
    Truncated {
        /// The structure.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// A magic number is wrong.
    #[error("bad {what} magic {got:#x}")]
    BadMagic {
        /// The structure.
        what: &'static str,
        /// The value received.
        got: u64,
    },
    /// A length field is beyond what this server accepts.
    #[error("{what} length {len} exceeds the limit {max}")]
    TooLong {
        /// The field.
        what: &'static str,
        /// The value received.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The client's handshake flags are unusable.
    #[error("client flags {0:#x}: unknown bits, or fixed newstyle not set")]
    ClientFlags(u32),
}

fn be_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}
fn need(what: &'static str, b: &[u8], n: usize) -> Result<(), ProtocolError> {
    if b.len() < n {
        Err(ProtocolError::Truncated { what, need: n, have: b.len() })
    } else {
        Ok(())
    }
}

/// The server's greeting: `NBDMAGIC`, `IHAVEOPT`, handshake flags.
pub fn emit_greeting(flags: u16) -> [u8; 18] {
    let mut out = [0u8; 18];
    out[0..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    out[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    out[16..18].copy_from_slice(&flags.to_be_bytes());
    out
}

/// Checks the client's 4-byte flags: only `FIXED_NEWSTYLE` and `NO_ZEROES` are known, and this
/// server only speaks fixed newstyle, so `FIXED_NEWSTYLE` must be set.
pub fn parse_client_flags(b: &[u8]) -> Result<u32, ProtocolError> {
    need("client flags", b, 4)?;
    let flags = be_u32(b, 0);
    let known = CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES;
    if flags & !known != 0 || flags & CLIENT_FLAG_FIXED_NEWSTYLE == 0 {
        return Err(ProtocolError::ClientFlags(flags));
    }
    Ok(flags)
}

/// The 16-byte header of a client option: `IHAVEOPT`, option, payload length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// The option code (`OPT_*`).
    pub option: u32,
    /// Payload bytes that follow.
    pub length: u32,
}

impl OptionHeader {
    /// Bytes on the wire.
    pub const LEN: usize = 16;

    /// Parses and checks the magic and the length limit ([`MAX_OPTION_BYTES`]).
    pub fn parse(b: &[u8]) -> Result<Self, ProtocolError> {
        need("option header", b, Self::LEN)?;
        let magic = be_u64(b, 0);
        if magic != IHAVEOPT {
            return Err(ProtocolError::BadMagic { what: "option", got: magic });
        }
        let h = OptionHeader { option: be_u32(b, 8), length: be_u32(b, 12) };
        if h.length > MAX_OPTION_BYTES {
            return Err(ProtocolError::TooLong {
                what: "option",
                len: h.length.into(),
                max: MAX_OPTION_BYTES.into(),
            });
        }
        Ok(h)
    }

    /// Writes the header (the client's side).
    pub fn emit(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        out[8..12].copy_from_slice(&self.option.to_be_bytes());
        out[12..16].copy_from_slice(&self.length.to_be_bytes());
        out
    }
}

/// The 20-byte header of an option reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    /// The option answered.
    pub option: u32,
    /// `REP_*`.
    pub reply: u32,
    /// Payload bytes that follow.
    pub length: u32,
}

impl OptionReplyHeader {
    /// Bytes on the wire.
    pub const LEN: usize = 20;

    /// Writes the header.
    pub fn emit(&self) -> [u8; 20] {
        let mut out = [0u8; 20];
        out[0..8].copy_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
        out[8..12].copy_from_slice(&self.option.to_be_bytes());
        out[12..16].copy_from_slice(&self.reply.to_be_bytes());
        out[16..20].copy_from_slice(&self.length.to_be_bytes());
        out
    }

    /// Parses a reply header (the client's side).
    pub fn parse(b: &[u8]) -> Result<Self, ProtocolError> {
        need("option reply", b, Self::LEN)?;
        let magic = be_u64(b, 0);
        if magic != OPTION_REPLY_MAGIC {
            return Err(ProtocolError::BadMagic { what: "option reply", got: magic });
        }
        Ok(OptionReplyHeader { option: be_u32(b, 8), reply: be_u32(b, 12), length: be_u32(b, 16) })
    }
}

/// The payload of `NBD_OPT_INFO` / `NBD_OPT_GO`: an export name and the information requested.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest<'a> {
    /// Export name (raw bytes; empty means the default export).
    pub name: &'a [u8],
    /// The information types asked for, in order.
    pub requests: Vec<u16>,
}

/// Why an option payload is refused (answered with `NBD_REP_ERR_INVALID`; the connection goes on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed option payload: {0}")]
pub struct InvalidOption(pub &'static str);

/// Parses the `NBD_OPT_INFO` / `NBD_OPT_GO` payload: u32 name length, name, u16 count, u16 each.
/// The lengths must add up exactly.
pub fn parse_info_request(payload: &[u8]) -> Result<InfoRequest<'_>, InvalidOption> {
    if payload.len() < 6 {
        return Err(InvalidOption("shorter than name length and request count"));
    }
    let name_len = be_u32(payload, 0) as usize;
    if name_len > MAX_NAME_BYTES {
        return Err(InvalidOption("export name longer than 4096 bytes"));
    }
    // name_len <= 4096, so the sum cannot overflow.
    if payload.len() < 4 + name_len + 2 {
        return Err(InvalidOption("name length beyond the payload"));
    }
    let name = &payload[4..4 + name_len];
    let count = usize::from(be_u16(payload, 4 + name_len));
    let rest = &payload[4 + name_len + 2..];
    if rest.len() != 2 * count {
        return Err(InvalidOption("information request count does not match the payload"));
    }
    let requests = rest.chunks_exact(2).map(|c| u16::from_be_bytes([c[0], c[1]])).collect();
    Ok(InfoRequest { name, requests })
}

/// Builds an `NBD_OPT_INFO` / `NBD_OPT_GO` payload (the client's side).
pub fn emit_info_request(name: &[u8], requests: &[u16]) -> Vec<u8> {
    let mut out = Vec::with_capacity(6 + name.len() + 2 * requests.len());
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name);
    out.extend_from_slice(&(requests.len() as u16).to_be_bytes());
    for r in requests {
        out.extend_from_slice(&r.to_be_bytes());
    }
    out
}

/// `NBD_INFO_EXPORT` payload: type, size, transmission flags.
pub fn emit_info_export(size_bytes: u64, transmission_flags: u16) -> [u8; 12] {
    let mut out = [0u8; 12];
    out[0..2].copy_from_slice(&INFO_EXPORT.to_be_bytes());
    out[2..10].copy_from_slice(&size_bytes.to_be_bytes());
    out[10..12].copy_from_slice(&transmission_flags.to_be_bytes());
    out
}

/// `NBD_INFO_BLOCK_SIZE` payload: type, minimum, preferred, maximum.
pub fn emit_info_block_size(min: u32, preferred: u32, max: u32) -> [u8; 14] {
    let mut out = [0u8; 14];
    out[0..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    out[2..6].copy_from_slice(&min.to_be_bytes());
    out[6..10].copy_from_slice(&preferred.to_be_bytes());
    out[10..14].copy_from_slice(&max.to_be_bytes());
    out
}

/// Request types of the transmission phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    /// `NBD_CMD_READ` (0).
    Read,
    /// `NBD_CMD_WRITE` (1), followed by `length` bytes of payload.
    Write,
    /// `NBD_CMD_DISC` (2): orderly disconnect.
    Disc,
    /// `NBD_CMD_FLUSH` (3).
    Flush,
    /// `NBD_CMD_TRIM` (4).
    Trim,
    /// `NBD_CMD_WRITE_ZEROES` (6).
    WriteZeroes,
    /// Any other value (CACHE, BLOCK_STATUS, RESIZE... are not offered): answered `EINVAL`.
    Unknown(u16),
}

impl Command {
    /// From the wire value.
    pub const fn from_u16(v: u16) -> Command {
        match v {
            0 => Command::Read,
            1 => Command::Write,
            2 => Command::Disc,
            3 => Command::Flush,
            4 => Command::Trim,
            6 => Command::WriteZeroes,
            other => Command::Unknown(other),
        }
    }

    /// The wire value.
    pub const fn as_u16(self) -> u16 {
        match self {
            Command::Read => 0,
            Command::Write => 1,
            Command::Disc => 2,
            Command::Flush => 3,
            Command::Trim => 4,
            Command::WriteZeroes => 6,
            Command::Unknown(v) => v,
        }
    }
}

/// The 28-byte request header of the transmission phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// Command flags (`CMD_FLAG_*`).
    pub flags: u16,
    /// The command.
    pub command: Command,
    /// The client's cookie, echoed in the reply.
    pub handle: u64,
    /// Byte offset into the export.
    pub offset: u64,
    /// Byte length (and payload length for WRITE).
    pub length: u32,
}

impl RequestHeader {
    /// Bytes on the wire.
    pub const LEN: usize = 28;

    /// Parses and checks the magic.
    pub fn parse(b: &[u8]) -> Result<Self, ProtocolError> {
        need("request", b, Self::LEN)?;
        let magic = be_u32(b, 0);
        if magic != REQUEST_MAGIC {
            return Err(ProtocolError::BadMagic { what: "request", got: magic.into() });
        }
        Ok(RequestHeader {
            flags: be_u16(b, 4),
            command: Command::from_u16(be_u16(b, 6)),
            handle: be_u64(b, 8),
            offset: be_u64(b, 16),
            length: be_u32(b, 24),
        })
    }

    /// Writes the header (the client's side).
    pub fn emit(&self) -> [u8; 28] {
        let mut out = [0u8; 28];
        out[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&self.flags.to_be_bytes());
        out[6..8].copy_from_slice(&self.command.as_u16().to_be_bytes());
        out[8..16].copy_from_slice(&self.handle.to_be_bytes());
        out[16..24].copy_from_slice(&self.offset.to_be_bytes());
        out[24..28].copy_from_slice(&self.length.to_be_bytes());
        out
    }

    /// Payload bytes that follow this header on the wire (only WRITE carries one). The server must
    /// consume them even when it refuses the request.
    pub fn payload_len(&self) -> u32 {
        if self.command == Command::Write {
            self.length
        } else {
            0
        }
    }
}

/// The 16-byte simple reply header (followed by the data of a successful READ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    /// 0, or an errno value.
    pub error: u32,
    /// The request's cookie.
    pub handle: u64,
}

impl SimpleReply {
    /// Bytes on the wire.
    pub const LEN: usize = 16;

    /// Writes the header into the first 16 bytes of `out` (which must hold them).
    pub fn emit_into(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        out[4..8].copy_from_slice(&self.error.to_be_bytes());
        out[8..16].copy_from_slice(&self.handle.to_be_bytes());
    }

    /// Parses a reply header (the client's side).
    pub fn parse(b: &[u8]) -> Result<Self, ProtocolError> {
        need("simple reply", b, Self::LEN)?;
        let magic = be_u32(b, 0);
        if magic != SIMPLE_REPLY_MAGIC {
            return Err(ProtocolError::BadMagic { what: "reply", got: magic.into() });
        }
        Ok(SimpleReply { error: be_u32(b, 4), handle: be_u64(b, 8) })
    }
}

/// What the server needs to know about an export to check a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportLimits {
    /// Export size in bytes (a multiple of `min_block`).
    pub size_bytes: u64,
    /// Minimum block size: offsets and lengths must be multiples of it (a power of two).
    pub min_block: u32,
    /// Largest READ/WRITE length.
    pub max_payload: u32,
    /// Writes, trims and zeroing are refused with `EPERM`.
    pub read_only: bool,
}

/// A request that passed every check: what the device must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Read `length` bytes at `offset`.
    Read {
        /// Byte offset.
        offset: u64,
        /// Byte length (at most `max_payload`).
        length: u32,
    },
    /// Write the `length`-byte payload at `offset`.
    Write {
        /// Byte offset.
        offset: u64,
        /// Byte length (at most `max_payload`).
        length: u32,
        /// Durable before the reply.
        fua: bool,
    },
    /// Make every completed write durable.
    Flush,
    /// Discard a range (advisory).
    Trim {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        length: u32,
        /// Durable before the reply.
        fua: bool,
    },
    /// Write zeroes over a range.
    WriteZeroes {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        length: u32,
        /// Durable before the reply.
        fua: bool,
        /// The device may punch a hole (the client did not set `NO_HOLE`).
        may_trim: bool,
    },
    /// The client is leaving: finish in-flight requests and close.
    Disconnect,
}

/// Checks one request against an export (spec "Request types" and "Error values"): unknown
/// commands or flags, misaligned ranges, reads beyond the end and oversized READ/WRITE get
/// `EINVAL`; writes (and zeroing) beyond the end get `ENOSPC`; modifications of a read-only export
/// get `EPERM`. FLUSH ignores offset and length, as the spec lets servers do.
pub fn check_request(h: &RequestHeader, limits: &ExportLimits) -> Result<Action, Errno> {
    let known_flags = CMD_FLAG_FUA | CMD_FLAG_NO_HOLE;
    if h.flags & !known_flags != 0 {
        return Err(Errno::Inval);
    }
    let fua = h.flags & CMD_FLAG_FUA != 0;
    if h.flags & CMD_FLAG_NO_HOLE != 0 && h.command != Command::WriteZeroes {
        return Err(Errno::Inval);
    }
    let range = |beyond_end: Errno| -> Result<(), Errno> {
        let min = u64::from(limits.min_block.max(1));
        if !h.offset.is_multiple_of(min) || !u64::from(h.length).is_multiple_of(min) {
            return Err(Errno::Inval);
        }
        match h.offset.checked_add(u64::from(h.length)) {
            Some(end) if end <= limits.size_bytes => Ok(()),
            _ => Err(beyond_end),
        }
    };
    let writable = || if limits.read_only { Err(Errno::Perm) } else { Ok(()) };
    match h.command {
        Command::Read => {
            if h.length > limits.max_payload {
                return Err(Errno::Inval);
            }
            range(Errno::Inval)?;
            Ok(Action::Read { offset: h.offset, length: h.length })
        }
        Command::Write => {
            writable()?;
            if h.length > limits.max_payload {
                return Err(Errno::Inval);
            }
            range(Errno::NoSpc)?;
            Ok(Action::Write { offset: h.offset, length: h.length, fua })
        }
        Command::Flush => Ok(Action::Flush),
        Command::Trim => {
            writable()?;
            range(Errno::Inval)?;
            Ok(Action::Trim { offset: h.offset, length: h.length, fua })
        }
        Command::WriteZeroes => {
            writable()?;
            range(Errno::NoSpc)?;
            let may_trim = h.flags & CMD_FLAG_NO_HOLE == 0;
            Ok(Action::WriteZeroes { offset: h.offset, length: h.length, fua, may_trim })
        }
        Command::Disc => Ok(Action::Disconnect),
        Command::Unknown(_) => Err(Errno::Inval),
    }
}

/// Fuzz entry (target `nbd_request`): `data` is a stream of transmission-phase bytes. Parses
/// request after request, checks each against a small export and skips WRITE payloads, as the
/// server's reader does. Asserts that a parsed header re-emits to the same bytes and that an
/// accepted request lies inside the export. Never panics otherwise.
#[cfg(any(test, fuzzing))]
pub fn fuzz_request(data: &[u8]) {
    let limits = ExportLimits { size_bytes: 1 << 20, min_block: 512, max_payload: 1 << 16, read_only: false };
    let ro = ExportLimits { read_only: true, ..limits };
    let mut rest = data;
    while rest.len() >= RequestHeader::LEN {
        let header = match RequestHeader::parse(rest) {
            Ok(h) => h,
            Err(_) => return,
        };
        assert_eq!(&header.emit()[..], &rest[..RequestHeader::LEN], "request does not round-trip");
        for l in [&limits, &ro] {
            match check_request(&header, l) {
                Ok(Action::Read { offset, length })
                | Ok(Action::Write { offset, length, .. })
                | Ok(Action::Trim { offset, length, .. })
                | Ok(Action::WriteZeroes { offset, length, .. }) => {
                    assert!(offset + u64::from(length) <= l.size_bytes);
                    assert!(!l.read_only || matches!(header.command, Command::Read));
                }
                Ok(_) | Err(_) => {}
            }
        }
        rest = &rest[RequestHeader::LEN..];
        let skip = (header.payload_len() as usize).min(rest.len());
        rest = &rest[skip..];
    }
}

/// Fuzz entry for option payloads: parses `data` as an option header followed by its payload and,
/// for INFO/GO, as an information request that must re-emit to the same bytes.
#[cfg(any(test, fuzzing))]
pub fn fuzz_option(data: &[u8]) {
    let _ = parse_client_flags(data);
    if let Ok(h) = OptionHeader::parse(data) {
        assert_eq!(&h.emit()[..], &data[..OptionHeader::LEN]);
    }
    if let Ok(req) = parse_info_request(data) {
        assert_eq!(emit_info_request(req.name, &req.requests), data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // READ of 4096 bytes at 8192, cookie 0x0102030405060708, FUA set.
    static READ: [u8; 28] = [
        0x25, 0x60, 0x95, 0x13, 0x00, 0x01, 0x00, 0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0, 0,
        0, 0, 0, 0, 0x20, 0x00, 0x00, 0x00, 0x10, 0x00,
    ];

    #[test]
    fn device_errors_map_to_the_errnos_nbd_defines() {
        let io = |n| DeviceError::Io(std::io::Error::from_raw_os_error(n));
        let cases = [
            (DeviceError::OutOfRange { offset: 0, len: 1, size: 0 }, Errno::Inval),
            (DeviceError::Misaligned { offset: 1, len: 1, block: 512 }, Errno::Inval),
            (DeviceError::InvalidArgument("field".into()), Errno::Inval),
            (DeviceError::ReadOnly, Errno::Perm),
            (DeviceError::NoSpace, Errno::NoSpc),
            (DeviceError::NoMemory("pages".into()), Errno::NoMem),
            (DeviceError::Unsupported("trim".into()), Errno::NotSup),
            (DeviceError::TimedOut("read".into()), Errno::Io),
            (DeviceError::Failed("media".into()), Errno::Io),
            (io(28), Errno::NoSpc),
            (io(30), Errno::Perm),
            (io(12), Errno::NoMem),
            (io(5), Errno::Io),
            (DeviceError::Io(std::io::ErrorKind::UnexpectedEof.into()), Errno::Io),
        ];
        for (e, want) in cases {
            assert_eq!(Errno::of(&e), want, "{e}");
        }
    }

    fn limits() -> ExportLimits {
        ExportLimits { size_bytes: 1 << 20, min_block: 512, max_payload: MAX_PAYLOAD_BYTES, read_only: false }
    }

    fn req(command: Command, flags: u16, offset: u64, length: u32) -> RequestHeader {
        RequestHeader { flags, command, handle: 7, offset, length }
    }

    #[test]
    fn request_fixture_parses_and_emits() {
        let h = RequestHeader::parse(&READ).unwrap();
        assert_eq!(h, req(Command::Read, CMD_FLAG_FUA, 8192, 4096).with_handle(0x0102_0304_0506_0708));
        assert_eq!(h.emit(), READ);
        let mut bad = READ;
        bad[0] = 0;
        assert!(matches!(RequestHeader::parse(&bad), Err(ProtocolError::BadMagic { .. })));
        assert!(matches!(RequestHeader::parse(&READ[..27]), Err(ProtocolError::Truncated { .. })));
    }

    impl RequestHeader {
        fn with_handle(mut self, handle: u64) -> Self {
            self.handle = handle;
            self
        }
    }

    #[test]
    fn greeting_and_reply_fixtures() {
        let g = emit_greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        assert_eq!(&g[..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(&g[16..], &[0, 3]);
        let mut r = [0u8; 16];
        SimpleReply { error: 22, handle: 9 }.emit_into(&mut r);
        assert_eq!(r, [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 22, 0, 0, 0, 0, 0, 0, 0, 9]);
        assert_eq!(SimpleReply::parse(&r).unwrap(), SimpleReply { error: 22, handle: 9 });
        let o = OptionReplyHeader { option: OPT_GO, reply: REP_ERR_UNSUP, length: 0 };
        assert_eq!(OptionReplyHeader::parse(&o.emit()).unwrap(), o);
        assert_eq!(&o.emit()[12..16], &[0x80, 0, 0, 1]);
    }

    #[test]
    fn client_flags() {
        assert_eq!(parse_client_flags(&[0, 0, 0, 3]), Ok(3));
        assert_eq!(parse_client_flags(&[0, 0, 0, 1]), Ok(1));
        assert!(parse_client_flags(&[0, 0, 0, 2]).is_err(), "fixed newstyle is required");
        assert!(parse_client_flags(&[0, 0, 0, 5]).is_err(), "unknown bits are refused");
        assert!(parse_client_flags(&[0, 0, 1]).is_err());
    }

    #[test]
    fn option_header_limits() {
        let h = OptionHeader { option: OPT_GO, length: 10 };
        assert_eq!(OptionHeader::parse(&h.emit()).unwrap(), h);
        let huge = OptionHeader { option: OPT_GO, length: MAX_OPTION_BYTES + 1 };
        assert!(matches!(OptionHeader::parse(&huge.emit()), Err(ProtocolError::TooLong { .. })));
        let mut bad = h.emit();
        bad[7] ^= 1;
        assert!(matches!(OptionHeader::parse(&bad), Err(ProtocolError::BadMagic { .. })));
    }

    #[test]
    fn info_request_round_trip_and_errors() {
        let p = emit_info_request(b"export", &[INFO_BLOCK_SIZE, INFO_NAME]);
        let r = parse_info_request(&p).unwrap();
        assert_eq!(r.name, b"export");
        assert_eq!(r.requests, vec![INFO_BLOCK_SIZE, INFO_NAME]);
        assert!(parse_info_request(&p[..p.len() - 1]).is_err(), "count mismatch");
        let mut extra = p.clone();
        extra.push(0);
        assert!(parse_info_request(&extra).is_err(), "trailing byte");
        let mut long = p.clone();
        long[0..4].copy_from_slice(&100u32.to_be_bytes());
        assert!(parse_info_request(&long).is_err(), "name beyond payload");
        long[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_info_request(&long).is_err(), "huge name");
        assert_eq!(parse_info_request(&emit_info_request(b"", &[])).unwrap().name, b"");
    }

    #[test]
    fn checks_follow_the_spec() {
        let l = limits();
        let ro = ExportLimits { read_only: true, ..l };
        assert_eq!(
            check_request(&req(Command::Read, 0, 0, 4096), &l),
            Ok(Action::Read { offset: 0, length: 4096 })
        );
        assert_eq!(check_request(&req(Command::Read, 0, (1 << 20) - 512, 1024), &l), Err(Errno::Inval));
        assert_eq!(check_request(&req(Command::Write, 0, (1 << 20) - 512, 1024), &l), Err(Errno::NoSpc));
        assert_eq!(check_request(&req(Command::WriteZeroes, 0, 1 << 20, 512), &l), Err(Errno::NoSpc));
        assert_eq!(check_request(&req(Command::Trim, 0, 1 << 20, 512), &l), Err(Errno::Inval));
        assert_eq!(check_request(&req(Command::Read, 0, u64::MAX - 511, 1024), &l), Err(Errno::Inval));
        assert_eq!(check_request(&req(Command::Read, 0, 100, 512), &l), Err(Errno::Inval), "misaligned");
        assert_eq!(check_request(&req(Command::Write, 0, 0, 100), &l), Err(Errno::Inval), "misaligned");
        let big = ExportLimits { size_bytes: 1 << 30, ..l };
        assert_eq!(
            check_request(&req(Command::Read, 0, 0, MAX_PAYLOAD_BYTES + 512), &big),
            Err(Errno::Inval)
        );
        assert_eq!(
            check_request(&req(Command::Trim, 0, 0, MAX_PAYLOAD_BYTES + 512), &big),
            Ok(Action::Trim { offset: 0, length: MAX_PAYLOAD_BYTES + 512, fua: false }),
            "TRIM has no payload, so no payload limit"
        );
        assert_eq!(check_request(&req(Command::Write, 0, 0, 512), &ro), Err(Errno::Perm));
        assert_eq!(check_request(&req(Command::Trim, 0, 0, 512), &ro), Err(Errno::Perm));
        assert_eq!(check_request(&req(Command::WriteZeroes, 0, 0, 512), &ro), Err(Errno::Perm));
        assert_eq!(check_request(&req(Command::Flush, 0, 0, 0), &ro), Ok(Action::Flush));
        assert_eq!(check_request(&req(Command::Unknown(5), 0, 0, 0), &l), Err(Errno::Inval));
        assert_eq!(check_request(&req(Command::Read, 1 << 7, 0, 512), &l), Err(Errno::Inval), "unknown flag");
        assert_eq!(check_request(&req(Command::Write, CMD_FLAG_NO_HOLE, 0, 512), &l), Err(Errno::Inval));
        assert_eq!(
            check_request(&req(Command::WriteZeroes, CMD_FLAG_NO_HOLE | CMD_FLAG_FUA, 512, 512), &l),
            Ok(Action::WriteZeroes { offset: 512, length: 512, fua: true, may_trim: false })
        );
        assert_eq!(check_request(&req(Command::Disc, 0, 0, 0), &l), Ok(Action::Disconnect));
    }

    #[test]
    fn corpus_seeds_are_handled() {
        fuzz_request(&READ);
        let mut w = req(Command::Write, 0, 0, 4).emit().to_vec();
        w.extend_from_slice(&[1, 2, 3, 4]);
        w.extend_from_slice(&READ);
        fuzz_request(&w);
        fuzz_option(&emit_info_request(b"x", &[3]));
    }

    #[test]
    fn committed_fuzz_corpus_runs() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
        let mut n = 0;
        for (target, f) in [
            ("nbd_request", fuzz_request as fn(&[u8])),
            ("nbd_handshake", crate::handshake::fuzz_handshake as fn(&[u8])),
        ] {
            for entry in std::fs::read_dir(root.join(target)).unwrap() {
                let bytes = std::fs::read(entry.unwrap().path()).unwrap();
                f(&bytes);
                fuzz_option(&bytes);
                n += 1;
            }
        }
        assert!(n >= 7, "corpus files missing");
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            fuzz_request(&bytes);
            fuzz_option(&bytes);
        }

        #[test]
        fn random_requests_never_panic(
            flags in 0u16..64, cmd in 0u16..10, offset in proptest::num::u64::ANY, length in proptest::num::u32::ANY
        ) {
            let mut b = req(Command::from_u16(cmd), flags, offset, length).emit().to_vec();
            b.extend_from_slice(&[0; 64]);
            fuzz_request(&b);
        }
    }
}
