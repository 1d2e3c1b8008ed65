//! The records the engines exchange, one per transport message (little-endian):
//!
//! ```text
//! every record   0 kind u8 | 1 version u8 (0) | 2 source id u16 | 4 destination id u16 | 6 zero u16
//! EAGER  (1)     8 context u32 | 12 tag u64 | 20.. the message
//! RTS    (2)     8 context u32 | 12 tag u64 | 20 length u64 | 28 send id u32          (32 bytes)
//! CTS    (3)     8 send id u32 | 12 receive id u32 | 16 granted u64                     (24 bytes)
//! DATA   (4)     8 receive id u32 | 12 offset u64 | 20.. bytes of the message
//! GONE   (5)     (the header only: engine `source id` is gone for good; 8 bytes)
//! ```
//!
//! An eager message travels whole in its EAGER record. A larger one is announced by an RTS; the
//! receiver answers with a CTS once a receive matches it, granting as many bytes as that receive
//! holds (fewer than the length: the message is truncated), and the sender then sends DATA
//! records placed by offset. A node whose engine went away (a process attached to a daemon that
//! exited) sends GONE for it, to destination 0 (every engine of the receiving node), so that
//! requests waiting on it fail instead of hanging. [`Record::parse`] accepts any bytes and says what is wrong.

/// Bytes before an EAGER record's message and a DATA record's bytes.
pub const EAGER_HEADER: usize = 20;
/// Bytes of a DATA record before its bytes.
pub const DATA_HEADER: usize = 20;
const RTS_LEN: usize = 32;
const CTS_LEN: usize = 24;
/// Record format version.
pub const VERSION: u8 = 0;

const EAGER: u8 = 1;
const RTS: u8 = 2;
const CTS: u8 = 3;
const DATA: u8 = 4;
const GONE: u8 = 5;
const GONE_LEN: usize = 8;

/// The endpoints of a record: ids of the sending and the receiving engine on their nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// The sending engine's id.
    pub src: u16,
    /// The receiving engine's id.
    pub dst: u16,
}

/// One record, borrowing its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record<'a> {
    /// A whole message.
    Eager {
        /// Matching context.
        context: u32,
        /// Tag.
        tag: u64,
        /// The message.
        data: &'a [u8],
    },
    /// A message of `len` bytes waits at the sender under `send_id`.
    Rts {
        /// Matching context.
        context: u32,
        /// Tag.
        tag: u64,
        /// The message's length.
        len: u64,
        /// The sender's handle for it.
        send_id: u32,
    },
    /// Send `granted` bytes of message `send_id`, tagged with `recv_id`.
    Cts {
        /// The sender's handle.
        send_id: u32,
        /// The receiver's handle.
        recv_id: u32,
        /// Bytes wanted (at most the message's length).
        granted: u64,
    },
    /// Bytes of a rendezvous message at `offset`.
    Data {
        /// The receiver's handle.
        recv_id: u32,
        /// Where the bytes go in the message.
        offset: u64,
        /// The bytes.
        data: &'a [u8],
    },
    /// The sending engine is gone for good: nothing more comes from it, nothing sent to it is
    /// received.
    Gone,
}

/// Why bytes are not a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseError {
    /// Fewer bytes than the kind's header.
    Short {
        /// Bytes there.
        len: usize,
        /// Bytes the header needs.
        need: usize,
    },
    /// A version this engine does not speak.
    Version(u8),
    /// An unknown kind.
    Kind(u8),
    /// A fixed-size record with bytes after it.
    Trailing(usize),
}

impl core::fmt::Display for ParseError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            ParseError::Short { len, need } => write!(f, "record of {len} bytes, its header needs {need}"),
            ParseError::Version(v) => write!(f, "record version {v}, this engine speaks {VERSION}"),
            ParseError::Kind(k) => write!(f, "unknown record kind {k}"),
            ParseError::Trailing(n) => write!(f, "{n} bytes after a fixed-size record"),
        }
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl<'a> Record<'a> {
    /// Parses one record.
    pub fn parse(b: &'a [u8]) -> Result<(Route, Record<'a>), ParseError> {
        if b.len() < 8 {
            return Err(ParseError::Short { len: b.len(), need: 8 });
        }
        if b[1] != VERSION {
            return Err(ParseError::Version(b[1]));
        }
        let route = Route { src: u16_at(b, 2), dst: u16_at(b, 4) };
        let need = match b[0] {
            EAGER => EAGER_HEADER,
            RTS => RTS_LEN,
            CTS => CTS_LEN,
            DATA => DATA_HEADER,
            GONE => GONE_LEN,
            k => return Err(ParseError::Kind(k)),
        };
        if b.len() < need {
            return Err(ParseError::Short { len: b.len(), need });
        }
        if matches!(b[0], RTS | CTS | GONE) && b.len() > need {
            return Err(ParseError::Trailing(b.len() - need));
        }
        let record = match b[0] {
            EAGER => Record::Eager { context: u32_at(b, 8), tag: u64_at(b, 12), data: &b[EAGER_HEADER..] },
            RTS => Record::Rts {
                context: u32_at(b, 8),
                tag: u64_at(b, 12),
                len: u64_at(b, 20),
                send_id: u32_at(b, 28),
            },
            CTS => Record::Cts { send_id: u32_at(b, 8), recv_id: u32_at(b, 12), granted: u64_at(b, 16) },
            GONE => Record::Gone,
            _ => Record::Data { recv_id: u32_at(b, 8), offset: u64_at(b, 12), data: &b[DATA_HEADER..] },
        };
        Ok((route, record))
    }

    /// How many bytes [`Record::emit`] appends.
    pub fn encoded_len(&self) -> usize {
        match self {
            Record::Eager { data, .. } => EAGER_HEADER + data.len(),
            Record::Rts { .. } => RTS_LEN,
            Record::Cts { .. } => CTS_LEN,
            Record::Data { data, .. } => DATA_HEADER + data.len(),
            Record::Gone => GONE_LEN,
        }
    }

    /// Appends the record, with its route, to `out`.
    pub fn emit(&self, route: Route, out: &mut Vec<u8>) {
        out.reserve(self.encoded_len());
        let kind = match self {
            Record::Eager { .. } => EAGER,
            Record::Rts { .. } => RTS,
            Record::Cts { .. } => CTS,
            Record::Data { .. } => DATA,
            Record::Gone => GONE,
        };
        out.extend_from_slice(&[kind, VERSION]);
        out.extend_from_slice(&route.src.to_le_bytes());
        out.extend_from_slice(&route.dst.to_le_bytes());
        out.extend_from_slice(&[0, 0]);
        match *self {
            Record::Eager { context, tag, data } => {
                out.extend_from_slice(&context.to_le_bytes());
                out.extend_from_slice(&tag.to_le_bytes());
                out.extend_from_slice(data);
            }
            Record::Rts { context, tag, len, send_id } => {
                out.extend_from_slice(&context.to_le_bytes());
                out.extend_from_slice(&tag.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
                out.extend_from_slice(&send_id.to_le_bytes());
            }
            Record::Cts { send_id, recv_id, granted } => {
                out.extend_from_slice(&send_id.to_le_bytes());
                out.extend_from_slice(&recv_id.to_le_bytes());
                out.extend_from_slice(&granted.to_le_bytes());
            }
            Record::Data { recv_id, offset, data } => {
                out.extend_from_slice(&recv_id.to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(data);
            }
            Record::Gone => {}
        }
    }
}

/// The destination engine id of a record, for a node that hands records to its engines; `None`
/// when the bytes are too short to say.
pub fn destination(b: &[u8]) -> Option<u16> {
    (b.len() >= 8).then(|| u16_at(b, 4))
}

/// The fuzz target's body: any bytes parse or fail with a reason; what parses emits back to the
/// same bytes.
#[cfg(any(test, fuzzing))]
pub fn fuzz_record(data: &[u8]) {
    match Record::parse(data) {
        Ok((route, record)) => {
            let mut out = Vec::new();
            record.emit(route, &mut out);
            // Byte 6..8 is reserved: emit writes zeroes there.
            assert_eq!(out.len(), data.len());
            assert_eq!(out[..6], data[..6]);
            assert_eq!(out[8..], data[8..]);
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_kind_round_trips() {
        let route = Route { src: 3, dst: 9 };
        let records = [
            Record::Eager { context: 1, tag: u64::MAX, data: b"hello" },
            Record::Eager { context: 0, tag: 0, data: b"" },
            Record::Rts { context: 7, tag: 42, len: 1 << 33, send_id: 5 },
            Record::Cts { send_id: 5, recv_id: 6, granted: 100 },
            Record::Data { recv_id: 6, offset: 4096, data: &[1, 2, 3] },
            Record::Gone,
        ];
        for r in records {
            let mut b = Vec::new();
            r.emit(route, &mut b);
            assert_eq!(b.len(), r.encoded_len());
            assert_eq!(Record::parse(&b).unwrap(), (route, r));
            assert_eq!(destination(&b), Some(9));
        }
    }

    #[test]
    fn bad_records_say_why() {
        assert_eq!(Record::parse(&[1, 0, 0]), Err(ParseError::Short { len: 3, need: 8 }));
        assert_eq!(Record::parse(&[1, 1, 0, 0, 0, 0, 0, 0]), Err(ParseError::Version(1)));
        assert_eq!(Record::parse(&[9, 0, 0, 0, 0, 0, 0, 0]), Err(ParseError::Kind(9)));
        assert_eq!(Record::parse(&[3, 0, 0, 0, 0, 0, 0, 0, 1]), Err(ParseError::Short { len: 9, need: 24 }));
        let mut cts = vec![0u8; CTS_LEN + 1];
        cts[0] = CTS;
        assert_eq!(Record::parse(&cts), Err(ParseError::Trailing(1)));
        assert_eq!(Record::parse(&[5, 0, 0, 0, 0, 0, 0, 0, 0]), Err(ParseError::Trailing(1)));
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            fuzz_record(&bytes);
        }

        #[test]
        fn kinds_with_random_fields_round_trip(kind in 1u8..=5, rest in proptest::collection::vec(any::<u8>(), 40)) {
            let mut b = vec![kind, VERSION];
            b.extend_from_slice(&rest[..4]);
            b.extend_from_slice(&[0, 0]);
            let len = match kind { 2 => RTS_LEN, 3 => CTS_LEN, 5 => GONE_LEN, _ => 20 + rest[39] as usize % 20 };
            b.extend_from_slice(&rest[4..(len - 8 + 4).min(40)]);
            b.resize(len, 7);
            fuzz_record(&b);
            let (route, record) = Record::parse(&b).expect("well formed");
            prop_assert_eq!(record.encoded_len(), len);
            let mut again = Vec::new();
            record.emit(route, &mut again);
            prop_assert_eq!(again.len(), len);
        }
    }
}
