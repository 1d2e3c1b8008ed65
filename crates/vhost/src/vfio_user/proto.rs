//! The vfio-user messages a server receives, decoded from a client's bytes, and the replies it
//! sends (the vfio-user protocol specification, version 0.1; the structures after the header are
//! those of Linux's VFIO ioctls).
//!
//! Layer: wire format, sans-IO. Every message is a 16-byte header (message ID, command, message
//! size, flags, error) and a body; all integers are little-endian.
//!
//! Invariants: nothing here trusts a length it reads. A header whose size is below the header's
//! own or above [`MAX_MESSAGE`] is a framing error (the connection cannot continue); a body too
//! short for its command, an argument size that does not cover the structure, a region access
//! larger than [`MAX_DATA_XFER`] or a version string that is not NUL-terminated UTF-8 is a
//! [`BadRequest`] answered with `EINVAL` while the connection goes on.

/// Header bytes.
pub const HEADER_LEN: usize = 16;
/// The most data one region access carries (offered to the client in the version reply).
pub const MAX_DATA_XFER: u32 = 1 << 20;
/// The largest message accepted: a region write of [`MAX_DATA_XFER`] bytes and its arguments.
pub const MAX_MESSAGE: u32 = HEADER_LEN as u32 + 16 + MAX_DATA_XFER;
/// File descriptors one message may carry (offered as `max_msg_fds`).
pub const MAX_FDS: usize = 64;

/// Commands.
pub mod command {
    /// Version and capabilities.
    pub const VERSION: u16 = 1;
    /// Add a DMA mapping.
    pub const DMA_MAP: u16 = 2;
    /// Remove DMA mappings.
    pub const DMA_UNMAP: u16 = 3;
    /// The device's flags, regions and interrupt types.
    pub const DEVICE_GET_INFO: u16 = 4;
    /// One region's size and flags.
    pub const DEVICE_GET_REGION_INFO: u16 = 5;
    /// Ioeventfds for a region.
    pub const GET_REGION_IO_FDS: u16 = 6;
    /// One interrupt type's vector count.
    pub const GET_IRQ_INFO: u16 = 7;
    /// Set up, trigger or tear down interrupts.
    pub const SET_IRQS: u16 = 8;
    /// Read a region.
    pub const REGION_READ: u16 = 9;
    /// Write a region.
    pub const REGION_WRITE: u16 = 10;
    /// Server to client: read client memory.
    pub const DMA_READ: u16 = 11;
    /// Server to client: write client memory.
    pub const DMA_WRITE: u16 = 12;
    /// Reset the device.
    pub const DEVICE_RESET: u16 = 13;
    /// Dirty page tracking.
    pub const USER_DIRTY_PAGES: u16 = 14;
}

/// Header flags: the low nibble is the type (0 command, 1 reply).
pub mod flags {
    /// A reply.
    pub const REPLY: u32 = 1;
    /// The sender wants no reply.
    pub const NO_REPLY: u32 = 1 << 4;
    /// The reply carries an error number.
    pub const ERROR: u32 = 1 << 5;
}

/// A message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Header {
    /// Chosen by the sender; the reply carries it back.
    pub id: u16,
    /// What the message asks.
    pub command: u16,
    /// Header and body bytes.
    pub size: u32,
    /// Type and flags ([`flags`]).
    pub flags: u32,
    /// An error number (replies only).
    pub error: u32,
}

/// Bytes that cannot be the start of a message: the stream is out of step and must end.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FramingError {
    /// The size field.
    #[error("a message of {0} bytes (at least {HEADER_LEN}, at most {MAX_MESSAGE})")]
    Size(u32),
    /// Not a command.
    #[error("a client message of type {0} (only commands are accepted)")]
    NotCommand(u32),
}

/// A message whose body does not fit its command; answered with `errno`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{why}")]
pub struct BadRequest {
    /// The error number to answer with.
    pub errno: i32,
    /// What was wrong (for the server's log).
    pub why: String,
}

fn bad(why: impl Into<String>) -> BadRequest {
    BadRequest { errno: libc::EINVAL, why: why.into() }
}

impl Header {
    /// Decodes a header a client sent.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, FramingError> {
        let h = Header {
            id: u16::from_le_bytes([b[0], b[1]]),
            command: u16::from_le_bytes([b[2], b[3]]),
            size: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            flags: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            error: u32::from_le_bytes([b[12], b[13], b[14], b[15]]),
        };
        if h.size < HEADER_LEN as u32 || h.size > MAX_MESSAGE {
            return Err(FramingError::Size(h.size));
        }
        if h.flags & 0xf != 0 {
            return Err(FramingError::NotCommand(h.flags & 0xf));
        }
        Ok(h)
    }

    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&self.id.to_le_bytes());
        b[2..4].copy_from_slice(&self.command.to_le_bytes());
        b[4..8].copy_from_slice(&self.size.to_le_bytes());
        b[8..12].copy_from_slice(&self.flags.to_le_bytes());
        b[12..16].copy_from_slice(&self.error.to_le_bytes());
        b
    }

    /// Body bytes.
    pub fn body_len(&self) -> usize {
        self.size as usize - HEADER_LEN
    }

    /// Whether the client asked for no reply.
    pub fn no_reply(&self) -> bool {
        self.flags & flags::NO_REPLY != 0
    }
}

/// A decoded client message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    /// `VERSION`: the client's version and its capabilities (JSON, may be empty).
    Version {
        /// Major version (0).
        major: u16,
        /// Minor version.
        minor: u16,
        /// The capabilities object, without its terminating NUL.
        capabilities: &'a str,
    },
    /// `DMA_MAP`: client memory at `address` (an I/O virtual address) for `size` bytes, at
    /// `offset` in the descriptor that came with the message.
    DmaMap {
        /// Read (1) and write (2) permission.
        flags: u32,
        /// Offset in the file.
        offset: u64,
        /// I/O virtual address.
        address: u64,
        /// Bytes.
        size: u64,
    },
    /// `DMA_UNMAP`.
    DmaUnmap {
        /// The argument size (echoed in the reply).
        argsz: u32,
        /// Flags (4: all mappings; 2: dirty bitmap, not supported).
        flags: u32,
        /// Start.
        address: u64,
        /// Bytes.
        size: u64,
    },
    /// `DEVICE_GET_INFO`.
    DeviceGetInfo {
        /// The reply space the client has.
        argsz: u32,
    },
    /// `DEVICE_GET_REGION_INFO`.
    RegionInfo {
        /// The reply space the client has.
        argsz: u32,
        /// Region index.
        index: u32,
    },
    /// `GET_IRQ_INFO`.
    IrqInfo {
        /// The reply space the client has.
        argsz: u32,
        /// Interrupt type index.
        index: u32,
    },
    /// `SET_IRQS`.
    SetIrqs {
        /// Data type and action bits.
        flags: u32,
        /// Interrupt type index.
        index: u32,
        /// First vector.
        start: u32,
        /// Vectors.
        count: u32,
        /// What follows the arguments (one byte per vector for boolean data).
        data: &'a [u8],
    },
    /// `REGION_READ`.
    RegionRead {
        /// Offset in the region.
        offset: u64,
        /// Region index.
        region: u32,
        /// Bytes.
        count: u32,
    },
    /// `REGION_WRITE`.
    RegionWrite {
        /// Offset in the region.
        offset: u64,
        /// Region index.
        region: u32,
        /// The bytes.
        data: &'a [u8],
    },
    /// `DEVICE_RESET`.
    Reset,
    /// A command this server does not serve (answered with `ENOTSUP`).
    Unsupported(u16),
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], BadRequest> {
        if self.0.len() < n {
            return Err(bad(format!("{what}: the body ends early")));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u16(&mut self, what: &str) -> Result<u16, BadRequest> {
        self.take(2, what).map(|b| u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32, BadRequest> {
        self.take(4, what).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64, BadRequest> {
        self.take(8, what).map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
    }
}

/// `argsz` must cover `need` bytes of arguments.
fn argsz(r: &mut Reader<'_>, need: u32, what: &str) -> Result<u32, BadRequest> {
    let a = r.u32(what)?;
    if a < need {
        return Err(bad(format!("{what}: argsz {a} below {need}")));
    }
    Ok(a)
}

/// Decodes the body of a message whose header is `h`.
pub fn decode<'a>(h: &Header, body: &'a [u8]) -> Result<Request<'a>, BadRequest> {
    use command::*;
    let mut r = Reader(body);
    Ok(match h.command {
        VERSION => {
            let major = r.u16("VERSION")?;
            let minor = r.u16("VERSION")?;
            let rest = r.0;
            let capabilities = match rest.split_last() {
                None => "",
                Some((0, text)) => {
                    std::str::from_utf8(text).map_err(|_| bad("VERSION: capabilities not UTF-8"))?
                }
                Some(_) => return Err(bad("VERSION: capabilities not NUL-terminated")),
            };
            if capabilities.contains('\0') {
                return Err(bad("VERSION: a NUL inside the capabilities"));
            }
            Request::Version { major, minor, capabilities }
        }
        DMA_MAP => {
            argsz(&mut r, 32, "DMA_MAP")?;
            let flags = r.u32("DMA_MAP")?;
            let offset = r.u64("DMA_MAP")?;
            let address = r.u64("DMA_MAP")?;
            let size = r.u64("DMA_MAP")?;
            Request::DmaMap { flags, offset, address, size }
        }
        DMA_UNMAP => {
            let argsz = argsz(&mut r, 24, "DMA_UNMAP")?;
            let flags = r.u32("DMA_UNMAP")?;
            let address = r.u64("DMA_UNMAP")?;
            let size = r.u64("DMA_UNMAP")?;
            Request::DmaUnmap { argsz, flags, address, size }
        }
        DEVICE_GET_INFO => Request::DeviceGetInfo { argsz: argsz(&mut r, 16, "DEVICE_GET_INFO")? },
        DEVICE_GET_REGION_INFO => {
            let argsz = argsz(&mut r, 32, "DEVICE_GET_REGION_INFO")?;
            r.u32("DEVICE_GET_REGION_INFO")?;
            Request::RegionInfo { argsz, index: r.u32("DEVICE_GET_REGION_INFO")? }
        }
        GET_IRQ_INFO => {
            let argsz = argsz(&mut r, 16, "GET_IRQ_INFO")?;
            r.u32("GET_IRQ_INFO")?;
            Request::IrqInfo { argsz, index: r.u32("GET_IRQ_INFO")? }
        }
        SET_IRQS => {
            argsz(&mut r, 20, "SET_IRQS")?;
            let flags = r.u32("SET_IRQS")?;
            let index = r.u32("SET_IRQS")?;
            let start = r.u32("SET_IRQS")?;
            let count = r.u32("SET_IRQS")?;
            Request::SetIrqs { flags, index, start, count, data: r.0 }
        }
        REGION_READ | REGION_WRITE => {
            let offset = r.u64("region access")?;
            let region = r.u32("region access")?;
            let count = r.u32("region access")?;
            if count > MAX_DATA_XFER {
                return Err(bad(format!("a region access of {count} bytes (at most {MAX_DATA_XFER})")));
            }
            if h.command == REGION_READ {
                if !r.0.is_empty() {
                    return Err(bad("REGION_READ: bytes after the arguments"));
                }
                Request::RegionRead { offset, region, count }
            } else {
                if r.0.len() != count as usize {
                    return Err(bad(format!("REGION_WRITE: count {count} but {} bytes of data", r.0.len())));
                }
                Request::RegionWrite { offset, region, data: r.0 }
            }
        }
        DEVICE_RESET => Request::Reset,
        other => Request::Unsupported(other),
    })
}

/// A reply to `h` with `body` after the header.
pub fn reply(h: &Header, body: &[&[u8]]) -> Vec<u8> {
    let len = HEADER_LEN + body.iter().map(|b| b.len()).sum::<usize>();
    let head = Header { id: h.id, command: h.command, size: len as u32, flags: flags::REPLY, error: 0 };
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&head.encode());
    for b in body {
        out.extend_from_slice(b);
    }
    out
}

/// An error reply to `h`.
pub fn error_reply(h: &Header, errno: i32) -> Vec<u8> {
    let head = Header {
        id: h.id,
        command: h.command,
        size: HEADER_LEN as u32,
        flags: flags::REPLY | flags::ERROR,
        error: errno as u32,
    };
    head.encode().to_vec()
}

/// Little-endian words, concatenated.
pub fn words(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Feeds arbitrary bytes to the decoders as a client's messages (the fuzz target's body).
pub fn fuzz_messages(mut data: &[u8]) {
    while data.len() >= HEADER_LEN {
        let (head, rest) = data.split_at(HEADER_LEN);
        let Ok(h) = Header::decode(head.try_into().expect("16 bytes")) else { return };
        let n = h.body_len().min(rest.len());
        let (body, next) = rest.split_at(n);
        if let Ok(Request::SetIrqs { data: d, count, .. }) = decode(&h, body) {
            let _ = d.get(..count as usize);
        }
        data = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header(command: u16, body: usize) -> Header {
        Header { id: 7, command, size: (HEADER_LEN + body) as u32, flags: 0, error: 0 }
    }

    #[test]
    fn messages_decode_as_the_specification_lays_them_out() {
        let body =
            [&words(&[32, 3])[..], &7u64.to_le_bytes(), &0x1000u64.to_le_bytes(), &0x2000u64.to_le_bytes()]
                .concat();
        assert_eq!(
            decode(&header(command::DMA_MAP, body.len()), &body).unwrap(),
            Request::DmaMap { flags: 3, offset: 7, address: 0x1000, size: 0x2000 }
        );
        let mut v = vec![0, 0, 1, 0];
        v.extend_from_slice(b"{\"capabilities\":{}}\0");
        assert_eq!(
            decode(&header(command::VERSION, v.len()), &v).unwrap(),
            Request::Version { major: 0, minor: 1, capabilities: "{\"capabilities\":{}}" }
        );
        let w = [&0x40u64.to_le_bytes()[..], &words(&[7, 3]), b"abc"].concat();
        assert_eq!(
            decode(&header(command::REGION_WRITE, w.len()), &w).unwrap(),
            Request::RegionWrite { offset: 0x40, region: 7, data: b"abc" }
        );
    }

    #[test]
    fn short_bodies_small_argsz_and_oversized_accesses_are_bad_requests() {
        let short = words(&[32, 3]);
        assert!(decode(&header(command::DMA_MAP, short.len()), &short).is_err());
        let small = [&words(&[8, 3])[..], &[0u8; 24]].concat();
        assert!(decode(&header(command::DMA_MAP, small.len()), &small).is_err());
        let big = [&0u64.to_le_bytes()[..], &words(&[0, MAX_DATA_XFER + 1])].concat();
        assert!(decode(&header(command::REGION_READ, big.len()), &big).is_err());
        let mismatch = [&0u64.to_le_bytes()[..], &words(&[0, 4]), b"ab"].concat();
        assert!(decode(&header(command::REGION_WRITE, mismatch.len()), &mismatch).is_err());
        let unterminated = [0u8, 0, 1, 0, b'{'];
        assert!(decode(&header(command::VERSION, 5), &unterminated).is_err());
    }

    #[test]
    fn headers_out_of_bounds_or_not_commands_are_framing_errors() {
        let mut h = header(command::VERSION, 0).encode();
        h[4..8].copy_from_slice(&8u32.to_le_bytes());
        assert_eq!(Header::decode(&h), Err(FramingError::Size(8)));
        h[4..8].copy_from_slice(&(MAX_MESSAGE + 1).to_le_bytes());
        assert!(Header::decode(&h).is_err());
        let mut r = header(command::VERSION, 0).encode();
        r[8] = 1;
        assert_eq!(Header::decode(&r), Err(FramingError::NotCommand(1)));
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_are_refused_without_panic(
            command in 0u16..20, body in proptest::collection::vec(any::<u8>(), 0..200)
        ) {
            let h = header(command, body.len());
            let _ = decode(&h, &body);
            let mut all = h.encode().to_vec();
            all.extend_from_slice(&body);
            fuzz_messages(&all);
        }

        #[test]
        fn headers_round_trip(id: u16, command: u16, size in 16u32..=MAX_MESSAGE, f in 0u32..16, error: u32) {
            let h = Header { id, command, size, flags: f << 4, error };
            prop_assert_eq!(Header::decode(&h.encode()), Ok(h));
        }

        #[test]
        fn replies_carry_the_id_and_their_length(id: u16, command: u16, body in proptest::collection::vec(any::<u8>(), 0..64)) {
            let h = Header { id, command, ..Header::default() };
            let r = reply(&h, &[&body]);
            let back = u32::from_le_bytes([r[4], r[5], r[6], r[7]]);
            prop_assert_eq!(back as usize, r.len());
            prop_assert_eq!(u16::from_le_bytes([r[0], r[1]]), id);
            prop_assert_eq!(&r[HEADER_LEN..], &body[..]);
            let e = error_reply(&h, libc::EINVAL);
            prop_assert_eq!(u32::from_le_bytes([e[8], e[9], e[10], e[11]]), flags::REPLY | flags::ERROR);
        }
    }
}
