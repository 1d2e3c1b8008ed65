//! The lanbus header (wire layer): what follows an Ethernet II header with EtherType 0x88B5.
//!
//! `docs/wire.md` draws every byte. In short, a 40-byte header:
//!
//! ```text
//!  0       1       2       3       4               6               8
//! +-------+-------+-------+-------+---------------+---------------+
//! |version| kind  | flags |  rsvd |     group     |    channel    |
//! +-------+-------+-------+-------+---------------+---------------+
//! |            sequence           |        cumulative ack         |   8..16
//! +-------------------------------+-------------------------------+
//! |     send timestamp (ns)       |    echoed timestamp (ns)      |  16..24
//! +---------------+---------------+-------------------------------+
//! | payload length|   hold (µs)   |           checksum            |  24..32
//! +---------------+---------------+-------------------------------+
//! |         sender's epoch        |   receiver's epoch (or 0)     |  32..40
//! +-------------------------------+-------------------------------+
//! ```
//!
//! An epoch names one incarnation of an endpoint (drawn anew each time it starts): a frame says
//! which incarnation sent it and which incarnation of the receiver it is meant for, so a peer that
//! restarts with the same MAC is told apart from its previous self, and frames of either old
//! incarnation are recognised as such.
//!
//! then `payload length` bytes: message records for DATA ([`MessageRecord`]), nothing for ACK, a
//! [`HeartbeatRepr`] for HEARTBEAT. Bytes after the payload (Ethernet minimum-size padding) are
//! ignored. All fields are big-endian; the checksum is the CRC-32C of the frame from the source MAC
//! on, with the field itself taken as zero (see [`fill_checksum`]).
//!
//! Invariants: after [`Packet::new_checked`] succeeds, every accessor is infallible and
//! `payload()` has exactly `payload_len` bytes. Nothing here panics on bytes from the network.

use core::fmt;

use crate::ethernet::HEADER_LEN as ETHERNET_HEADER_LEN;
use crate::{Error, Result};

/// The only version this implementation speaks. Frames with another version are dropped.
/// Version 2 added the epochs (and grew the header from 32 to 40 bytes).
pub const VERSION: u8 = 2;

/// Length of the lanbus header.
pub const HEADER_LEN: usize = 40;

/// Largest message the transport carries (64 KiB), segmented over as many frames as needed.
pub const MAX_MESSAGE_LEN: usize = 65_536;

/// Flag: the checksum field is valid and covers the frame.
pub const FLAG_CHECKSUM: u8 = 0x01;
/// Flag: the echoed timestamp field is valid.
pub const FLAG_ECHO: u8 = 0x02;
/// Flag (DATA frames): the cumulative ACK field is valid; the frame also acknowledges the
/// opposite direction of its channel (a piggybacked ACK), with [`FLAG_ECHO`] echoing a timestamp.
pub const FLAG_ACK: u8 = 0x04;
/// Flag (ACK frames): the payload is a [`Sack`] bitmap of frames received beyond the cumulative
/// ACK (selective repeat).
pub const FLAG_SACK: u8 = 0x08;
/// Flag: the frame is sealed by a fabric key (the authentication layer's): the checksum field holds
/// the session id (or, on a broadcast frame, the fabric key's id) and the payload is followed by a
/// 64-bit transmit counter and a 16-byte AEAD tag over the headers and payload.
pub const FLAG_SEALED: u8 = 0x10;
/// Flag (with [`FLAG_SEALED`]): the payload is encrypted, not only authenticated.
pub const FLAG_ENCRYPTED: u8 = 0x20;
/// Flag (with [`FLAG_SEALED`]): sealed under the sender's broadcast key (a heartbeat to its
/// group), the destination MAC left out of the tag (ports that carry no Ethernet header, udp,
/// rebuild it with their own address).
pub const FLAG_BROADCAST_KEY: u8 = 0x40;

/// Frames past the cumulative ACK that one [`Sack`] can report.
pub const SACK_MAX_FRAMES: usize = 256;

/// Which frames beyond a cumulative ACK `a` the receiver holds: bit `i` (bit `i % 8` of byte
/// `i / 8`, least significant first) is frame `a + 1 + i` (frame `a` itself is missing, or the ACK
/// would be past it). Carried as the payload of an ACK frame with [`FLAG_SACK`], as many bytes as
/// needed (at most [`SACK_MAX_FRAMES`] / 8); a longer payload is cut, so any bytes parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sack {
    bytes: [u8; SACK_MAX_FRAMES / 8],
    len: u8,
}

impl Sack {
    /// No frame beyond the cumulative ACK.
    pub const EMPTY: Sack = Sack { bytes: [0; SACK_MAX_FRAMES / 8], len: 0 };

    /// The bitmap in an ACK frame's payload (bytes beyond [`SACK_MAX_FRAMES`] / 8 are ignored).
    pub fn parse(payload: &[u8]) -> Sack {
        let mut s = Sack::EMPTY;
        let n = payload.len().min(s.bytes.len());
        s.bytes[..n].copy_from_slice(&payload[..n]);
        s.len = n as u8;
        s.trim();
        s
    }

    /// Marks frame `a + 1 + index` as received (indexes from [`SACK_MAX_FRAMES`] on are not
    /// reported).
    pub fn set(&mut self, index: usize) {
        if index < SACK_MAX_FRAMES {
            self.bytes[index / 8] |= 1 << (index % 8);
            self.len = self.len.max((index / 8 + 1) as u8);
        }
    }

    /// Whether frame `a + 1 + index` was received.
    pub fn get(&self, index: usize) -> bool {
        index < SACK_MAX_FRAMES && self.bytes[index / 8] & (1 << (index % 8)) != 0
    }

    /// Whether no frame is reported.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The indexes reported, in increasing order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (0..usize::from(self.len) * 8).filter(|&i| self.get(i))
    }

    /// The bitmap's wire form (no trailing zero bytes).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    fn trim(&mut self) {
        while self.len > 0 && self.bytes[usize::from(self.len) - 1] == 0 {
            self.len -= 1;
        }
    }
}

/// Where the checksum's coverage starts: the source MAC (see [`fill_checksum`]).
const CHECKSUM_START: usize = 6;

/// Offset of the checksum field from the start of the Ethernet frame.
pub const CHECKSUM_FRAME_OFFSET: usize = ETHERNET_HEADER_LEN + field::CHECKSUM.start;

mod field {
    use core::ops::Range;
    pub const VERSION: usize = 0;
    pub const KIND: usize = 1;
    pub const FLAGS: usize = 2;
    pub const RESERVED0: usize = 3;
    pub const GROUP: Range<usize> = 4..6;
    pub const CHANNEL: Range<usize> = 6..8;
    pub const SEQUENCE: Range<usize> = 8..12;
    pub const ACK: Range<usize> = 12..16;
    pub const TIMESTAMP: Range<usize> = 16..20;
    pub const ECHO: Range<usize> = 20..24;
    pub const PAYLOAD_LEN: Range<usize> = 24..26;
    pub const HOLD: Range<usize> = 26..28;
    pub const CHECKSUM: Range<usize> = 28..32;
    pub const EPOCH: Range<usize> = 32..36;
    pub const PEER_EPOCH: Range<usize> = 36..40;
}

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Message records of one channel, with a sequence number (1).
    Data,
    /// A cumulative acknowledgement of one channel (2).
    Ack,
    /// A periodic broadcast announcement of a node (3).
    Heartbeat,
    /// A step of the key handshake between two members of a keyed fabric (4); consumed by the
    /// authentication layer, never seen by the transport.
    Handshake,
    /// A probe, or its answer, between two nodes' ports on one of several paths (5); consumed by
    /// the multipath layer ([`PathRepr`]), never seen by the transport.
    Path,
    /// A code point this version does not know; receivers count and drop such frames.
    Unknown(u8),
}

impl From<u8> for Kind {
    fn from(v: u8) -> Self {
        match v {
            1 => Kind::Data,
            2 => Kind::Ack,
            3 => Kind::Heartbeat,
            4 => Kind::Handshake,
            5 => Kind::Path,
            other => Kind::Unknown(other),
        }
    }
}

impl From<Kind> for u8 {
    fn from(k: Kind) -> u8 {
        match k {
            Kind::Data => 1,
            Kind::Ack => 2,
            Kind::Heartbeat => 3,
            Kind::Handshake => 4,
            Kind::Path => 5,
            Kind::Unknown(other) => other,
        }
    }
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// A view of a lanbus header and its payload (the bytes after the Ethernet header).
#[derive(Debug, Clone)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps a buffer without checking; accessors panic if it is shorter than [`HEADER_LEN`] and
    /// `payload()` if it is shorter than the declared payload.
    pub const fn new_unchecked(buffer: T) -> Self {
        Packet { buffer }
    }

    /// Wraps untrusted bytes after [`Packet::check_len`].
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Packet { buffer };
        p.check_len()?;
        Ok(p)
    }

    /// Checks that the buffer holds the header and the payload it declares.
    pub fn check_len(&self) -> Result<()> {
        let have = self.buffer.as_ref().len();
        if have < HEADER_LEN {
            return Err(Error::Truncated { need: HEADER_LEN, have });
        }
        let need = HEADER_LEN + usize::from(self.payload_len());
        if have < need {
            return Err(Error::Truncated { need, have });
        }
        Ok(())
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Protocol version.
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VERSION]
    }

    /// Frame kind.
    pub fn kind(&self) -> Kind {
        Kind::from(self.buffer.as_ref()[field::KIND])
    }

    /// Flag bits ([`FLAG_CHECKSUM`], [`FLAG_ECHO`], and on DATA [`FLAG_ACK`]).
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }

    /// The sender's group.
    pub fn group(&self) -> u16 {
        be16(&self.buffer.as_ref()[field::GROUP])
    }

    /// Channel id.
    pub fn channel(&self) -> u16 {
        be16(&self.buffer.as_ref()[field::CHANNEL])
    }

    /// DATA: this frame's sequence number (wraps at 2^32).
    pub fn sequence(&self) -> u32 {
        be32(&self.buffer.as_ref()[field::SEQUENCE])
    }

    /// ACK frames, and DATA frames with [`FLAG_ACK`] (a piggybacked ACK): the next sequence
    /// number the receiver expects on the opposite direction of the channel (all before it
    /// arrived). Meaningless (sent 0) on other frames.
    pub fn ack(&self) -> u32 {
        be32(&self.buffer.as_ref()[field::ACK])
    }

    /// The sender's clock when it sent the frame: nanoseconds, truncated to 32 bits.
    pub fn timestamp(&self) -> u32 {
        be32(&self.buffer.as_ref()[field::TIMESTAMP])
    }

    /// The timestamp of the frame this one answers (valid if [`FLAG_ECHO`] is set).
    pub fn echo(&self) -> u32 {
        be32(&self.buffer.as_ref()[field::ECHO])
    }

    /// ACK, and DATA with [`FLAG_ACK`] and [`FLAG_ECHO`]: how long the receiver held the frame
    /// whose timestamp it echoes before this acknowledgement left, in microseconds (saturating
    /// at 65535). The sender leaves it out of the delay it reads as the fabric's queueing.
    pub fn hold_us(&self) -> u16 {
        be16(&self.buffer.as_ref()[field::HOLD])
    }

    /// Bytes of payload after the header.
    pub fn payload_len(&self) -> u16 {
        be16(&self.buffer.as_ref()[field::PAYLOAD_LEN])
    }

    /// The raw checksum field.
    pub fn checksum(&self) -> u32 {
        be32(&self.buffer.as_ref()[field::CHECKSUM])
    }

    /// The epoch of the endpoint that sent the frame: one value per incarnation.
    pub fn epoch(&self) -> u32 {
        be32(&self.buffer.as_ref()[field::EPOCH])
    }

    /// The receiver's epoch as the sender knows it: frames meant for an earlier incarnation of
    /// the receiver carry that one's. 0 when the sender has not heard the receiver yet (and on
    /// heartbeats, which go to everyone).
    pub fn peer_epoch(&self) -> u32 {
        be32(&self.buffer.as_ref()[field::PEER_EPOCH])
    }

    /// The payload (exactly `payload_len` bytes; padding after it is not included).
    pub fn payload(&self) -> &[u8] {
        let end = HEADER_LEN + usize::from(self.payload_len());
        &self.buffer.as_ref()[HEADER_LEN..end]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn set16(&mut self, r: core::ops::Range<usize>, v: u16) {
        self.buffer.as_mut()[r].copy_from_slice(&v.to_be_bytes());
    }

    fn set32(&mut self, r: core::ops::Range<usize>, v: u32) {
        self.buffer.as_mut()[r].copy_from_slice(&v.to_be_bytes());
    }

    /// Sets the version.
    pub fn set_version(&mut self, v: u8) {
        self.buffer.as_mut()[field::VERSION] = v;
    }

    /// Sets the kind.
    pub fn set_kind(&mut self, k: Kind) {
        self.buffer.as_mut()[field::KIND] = k.into();
    }

    /// Sets the flag bits.
    pub fn set_flags(&mut self, f: u8) {
        self.buffer.as_mut()[field::FLAGS] = f;
    }

    /// Sets the group.
    pub fn set_group(&mut self, g: u16) {
        self.set16(field::GROUP, g);
    }

    /// Sets the channel.
    pub fn set_channel(&mut self, c: u16) {
        self.set16(field::CHANNEL, c);
    }

    /// Sets the sequence number.
    pub fn set_sequence(&mut self, s: u32) {
        self.set32(field::SEQUENCE, s);
    }

    /// Sets the cumulative ACK.
    pub fn set_ack(&mut self, a: u32) {
        self.set32(field::ACK, a);
    }

    /// Sets the send timestamp.
    pub fn set_timestamp(&mut self, t: u32) {
        self.set32(field::TIMESTAMP, t);
    }

    /// Sets the echoed timestamp.
    pub fn set_echo(&mut self, t: u32) {
        self.set32(field::ECHO, t);
    }

    /// Sets the hold time reported with the echoed timestamp.
    pub fn set_hold_us(&mut self, us: u16) {
        self.set16(field::HOLD, us);
    }

    /// Sets the payload length.
    pub fn set_payload_len(&mut self, n: u16) {
        self.set16(field::PAYLOAD_LEN, n);
    }

    /// Sets the raw checksum field.
    pub fn set_checksum(&mut self, c: u32) {
        self.set32(field::CHECKSUM, c);
    }

    /// Sets the sender's epoch.
    pub fn set_epoch(&mut self, e: u32) {
        self.set32(field::EPOCH, e);
    }

    /// Sets the receiver's epoch as the sender knows it (0: not known).
    pub fn set_peer_epoch(&mut self, e: u32) {
        self.set32(field::PEER_EPOCH, e);
    }

    /// Zeroes the reserved bytes.
    pub fn clear_reserved(&mut self) {
        self.buffer.as_mut()[field::RESERVED0] = 0;
    }

    /// The payload, writable (panics if the buffer is shorter than the declared payload).
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let end = HEADER_LEN + usize::from(self.payload_len());
        &mut self.buffer.as_mut()[HEADER_LEN..end]
    }
}

/// The decoded lanbus header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// Frame kind.
    pub kind: Kind,
    /// Flag bits.
    pub flags: u8,
    /// The sender's group.
    pub group: u16,
    /// Channel id.
    pub channel: u16,
    /// Sequence number (DATA).
    pub sequence: u32,
    /// Cumulative ACK (ACK, and DATA with [`FLAG_ACK`]).
    pub ack: u32,
    /// Send timestamp, ns truncated to 32 bits.
    pub timestamp: u32,
    /// Echoed timestamp (ACK, and DATA with [`FLAG_ACK`]; valid with [`FLAG_ECHO`]).
    pub echo: u32,
    /// Payload length.
    pub payload_len: u16,
    /// Hold time of the echoed frame, µs (ACK, and DATA with [`FLAG_ACK`]).
    pub hold_us: u16,
    /// The sender's epoch.
    pub epoch: u32,
    /// The receiver's epoch as the sender knows it (0: not known).
    pub peer_epoch: u32,
}

impl Repr {
    /// Decodes a checked packet. Fails on a version other than [`VERSION`]; an unknown kind is
    /// returned as [`Kind::Unknown`] for the caller to count.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        if p.version() != VERSION {
            return Err(Error::Malformed { what: "lanbus version" });
        }
        Ok(Repr {
            kind: p.kind(),
            flags: p.flags(),
            group: p.group(),
            channel: p.channel(),
            sequence: p.sequence(),
            ack: p.ack(),
            timestamp: p.timestamp(),
            echo: p.echo(),
            payload_len: p.payload_len(),
            hold_us: p.hold_us(),
            epoch: p.epoch(),
            peer_epoch: p.peer_epoch(),
        })
    }

    /// Bytes the header takes (the payload is the caller's).
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header (version [`VERSION`], reserved bytes and checksum zero) into a buffer of
    /// at least [`HEADER_LEN`] bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        p.set_version(VERSION);
        p.set_kind(self.kind);
        p.set_flags(self.flags);
        p.clear_reserved();
        p.set_group(self.group);
        p.set_channel(self.channel);
        p.set_sequence(self.sequence);
        p.set_ack(self.ack);
        p.set_timestamp(self.timestamp);
        p.set_echo(self.echo);
        p.set_payload_len(self.payload_len);
        p.set_hold_us(self.hold_us);
        p.set_checksum(0);
        p.set_epoch(self.epoch);
        p.set_peer_epoch(self.peer_epoch);
    }
}

/// The CRC-32C (Castagnoli polynomial 0x1EDC6F41, reflected, as iSCSI, SCTP and ext4 use) of a
/// whole frame from its source MAC on, with the checksum field taken as zero. The destination MAC
/// is left out: tunnels that carry lanbus frames without an Ethernet header (the UDP port) rebuild
/// it, addressing a broadcast to the one receiver, and a corrupted destination is caught by the
/// receiver's address check anyway. A CRC of degree 32 detects every error of
/// up to three flipped bits in frames this size and every burst of up to 32 bits; a sum of words
/// does not (two flips of the same bit in two words cancel). Every frame is summed by its sender
/// and its receiver, on the round trip's path: see the `crc` module for how it is made fast.
fn frame_crc(frame: &[u8]) -> u32 {
    crate::crc::crc32c_zero_field(&frame[CHECKSUM_START..], CHECKSUM_FRAME_OFFSET - CHECKSUM_START)
}

/// Writes the checksum of a whole frame (`frame` = Ethernet header + lanbus header + payload,
/// nothing after) so that [`verify_checksum`] holds, and sets [`FLAG_CHECKSUM`] (which the
/// checksum covers). Panics if `frame` is shorter than the two headers (callers build frames
/// themselves).
pub fn fill_checksum(frame: &mut [u8]) {
    frame[ETHERNET_HEADER_LEN + field::FLAGS] |= FLAG_CHECKSUM;
    frame[CHECKSUM_FRAME_OFFSET..CHECKSUM_FRAME_OFFSET + 4].fill(0);
    let crc = crate::crc::crc32c(&frame[CHECKSUM_START..]);
    frame[CHECKSUM_FRAME_OFFSET..CHECKSUM_FRAME_OFFSET + 4].copy_from_slice(&crc.to_be_bytes());
}

/// [`fill_checksum`] for a frame that lies in two pieces: `head` (at least the two headers) and
/// then `body`, the rest of its payload, which is read once and not moved (a sender's memory
/// lent to the transport). The sum is the one over the whole frame, run from the one piece into
/// the other.
pub fn fill_checksum_parts(head: &mut [u8], body: &[u8]) {
    if body.is_empty() {
        return fill_checksum(head);
    }
    head[ETHERNET_HEADER_LEN + field::FLAGS] |= FLAG_CHECKSUM;
    head[CHECKSUM_FRAME_OFFSET..CHECKSUM_FRAME_OFFSET + 4].fill(0);
    let crc = crate::crc::crc32c_two(&head[CHECKSUM_START..], body);
    head[CHECKSUM_FRAME_OFFSET..CHECKSUM_FRAME_OFFSET + 4].copy_from_slice(&crc.to_be_bytes());
}

/// Whether a whole frame (exactly header + payload, without padding) carries a correct checksum.
pub fn verify_checksum(frame: &[u8]) -> bool {
    if frame.len() < CHECKSUM_FRAME_OFFSET + 4 {
        return false;
    }
    let stored = u32::from_be_bytes(
        frame[CHECKSUM_FRAME_OFFSET..CHECKSUM_FRAME_OFFSET + 4].try_into().expect("4-byte range"),
    );
    stored == frame_crc(frame)
}

/// Message-record flag: the first fragment of a message.
pub const RECORD_FIRST: u8 = 0x01;
/// Message-record flag: the last fragment of a message.
pub const RECORD_LAST: u8 = 0x02;
/// Length of a message record header.
pub const RECORD_HEADER_LEN: usize = 4;

/// One message record inside a DATA payload: a 4-byte header (fragment length u16, flags u8
/// with [`RECORD_FIRST`]/[`RECORD_LAST`], reserved u8) and the fragment. A whole small message is
/// one record with both flags; a big one is a FIRST record, middle records, and a LAST record, in
/// consecutive frames of one channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageRecord<'a> {
    /// [`RECORD_FIRST`] | [`RECORD_LAST`] bits.
    pub flags: u8,
    /// The fragment's bytes.
    pub data: &'a [u8],
}

impl<'a> MessageRecord<'a> {
    /// Bytes the record takes on the wire.
    pub fn buffer_len(&self) -> usize {
        RECORD_HEADER_LEN + self.data.len()
    }

    /// Writes the record at the start of `buf` and returns its length. Panics if `buf` is too short
    /// or the fragment is longer than 65535 bytes (callers size fragments by the MTU).
    pub fn emit(&self, buf: &mut [u8]) -> usize {
        let n = u16::try_from(self.data.len()).expect("fragment longer than 65535 bytes");
        buf[0..2].copy_from_slice(&n.to_be_bytes());
        buf[2] = self.flags;
        buf[3] = 0;
        buf[RECORD_HEADER_LEN..RECORD_HEADER_LEN + self.data.len()].copy_from_slice(self.data);
        self.buffer_len()
    }
}

/// Iterates over the message records of a DATA payload. Yields an error (once, then stops) if a
/// record header is truncated, declares more bytes than remain, or has unknown flag bits.
#[derive(Debug, Clone)]
pub struct Records<'a> {
    rest: &'a [u8],
    failed: bool,
}

impl<'a> Records<'a> {
    /// Records of `payload`.
    pub fn new(payload: &'a [u8]) -> Self {
        Records { rest: payload, failed: false }
    }
}

impl<'a> Iterator for Records<'a> {
    type Item = Result<MessageRecord<'a>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.rest.is_empty() {
            return None;
        }
        let rest = self.rest;
        if rest.len() < RECORD_HEADER_LEN {
            self.failed = true;
            return Some(Err(Error::Truncated { need: RECORD_HEADER_LEN, have: rest.len() }));
        }
        let n = usize::from(be16(&rest[0..2]));
        let flags = rest[2];
        if flags & !(RECORD_FIRST | RECORD_LAST) != 0 {
            self.failed = true;
            return Some(Err(Error::Malformed { what: "message record flags" }));
        }
        let end = RECORD_HEADER_LEN + n;
        if rest.len() < end {
            self.failed = true;
            return Some(Err(Error::Truncated { need: end, have: rest.len() }));
        }
        self.rest = &rest[end..];
        Some(Ok(MessageRecord { flags, data: &rest[RECORD_HEADER_LEN..end] }))
    }
}

/// A node's role, announced in heartbeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// A host that uses devices (1).
    Host,
    /// An I/O box that offers devices (2).
    Device,
    /// A code point this version does not know.
    Unknown(u8),
}

impl From<u8> for Role {
    fn from(v: u8) -> Self {
        match v {
            1 => Role::Host,
            2 => Role::Device,
            other => Role::Unknown(other),
        }
    }
}

impl From<Role> for u8 {
    fn from(r: Role) -> u8 {
        match r {
            Role::Host => 1,
            Role::Device => 2,
            Role::Unknown(other) => other,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Role::Host => f.write_str("host"),
            Role::Device => f.write_str("device"),
            Role::Unknown(v) => write!(f, "role#{v}"),
        }
    }
}

/// Longest node name a heartbeat carries.
pub const MAX_NAME_LEN: usize = 64;
/// Fixed part of a heartbeat payload.
pub const HEARTBEAT_FIXED_LEN: usize = 8;

/// A HEARTBEAT payload: role u8, name length u8 (≤ [`MAX_NAME_LEN`]), group u16, interval in
/// microseconds u32, then the name (UTF-8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeartbeatRepr<'a> {
    /// The node's role.
    pub role: Role,
    /// The node's group (the same as the header's group field).
    pub group: u16,
    /// How often the node announces itself, in microseconds.
    pub interval_us: u32,
    /// The node's name.
    pub name: &'a str,
}

impl<'a> HeartbeatRepr<'a> {
    /// Decodes a heartbeat payload (trailing bytes after the name are rejected).
    pub fn parse(payload: &'a [u8]) -> Result<Self> {
        if payload.len() < HEARTBEAT_FIXED_LEN {
            return Err(Error::Truncated { need: HEARTBEAT_FIXED_LEN, have: payload.len() });
        }
        let name_len = usize::from(payload[1]);
        if name_len > MAX_NAME_LEN {
            return Err(Error::Malformed { what: "heartbeat name length" });
        }
        let need = HEARTBEAT_FIXED_LEN + name_len;
        if payload.len() < need {
            return Err(Error::Truncated { need, have: payload.len() });
        }
        if payload.len() > need {
            return Err(Error::Malformed { what: "heartbeat length" });
        }
        let name = core::str::from_utf8(&payload[HEARTBEAT_FIXED_LEN..need])
            .map_err(|_| Error::Malformed { what: "heartbeat name" })?;
        Ok(HeartbeatRepr {
            role: Role::from(payload[0]),
            group: be16(&payload[2..4]),
            interval_us: be32(&payload[4..8]),
            name,
        })
    }

    /// Bytes the payload takes (the name is cut to [`MAX_NAME_LEN`] bytes by [`HeartbeatRepr::emit`]).
    pub fn buffer_len(&self) -> usize {
        HEARTBEAT_FIXED_LEN + self.name_bytes().len()
    }

    fn name_bytes(&self) -> &[u8] {
        let mut n = self.name.len().min(MAX_NAME_LEN);
        while !self.name.is_char_boundary(n) {
            n -= 1;
        }
        &self.name.as_bytes()[..n]
    }

    /// Writes the payload into `buf` (at least [`HeartbeatRepr::buffer_len`] bytes) and returns
    /// its length.
    pub fn emit(&self, buf: &mut [u8]) -> usize {
        let name = self.name_bytes();
        buf[0] = self.role.into();
        buf[1] = name.len() as u8;
        buf[2..4].copy_from_slice(&self.group.to_be_bytes());
        buf[4..8].copy_from_slice(&self.interval_us.to_be_bytes());
        buf[HEARTBEAT_FIXED_LEN..HEARTBEAT_FIXED_LEN + name.len()].copy_from_slice(name);
        HEARTBEAT_FIXED_LEN + name.len()
    }
}

/// Bytes of a PATH payload.
pub const PATH_LEN: usize = 32;

/// A PATH payload: a node's probe of one path to a peer node, or the peer's answer. The node's
/// own address (6 bytes), the sender's port index u8, flags u8 ([`PathRepr::answer`] is bit 0),
/// the probe's send time in nanoseconds u64 (an answer echoes its probe's), the frames the sender
/// received on this path from the addressee u64 (cumulative, wrapping), and 8 reserved bytes,
/// zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathRepr {
    /// The sending node's address (the same on all its paths).
    pub node: crate::MacAddr,
    /// Which of the sender's ports the frame left by.
    pub port: u8,
    /// An answer to a probe (else a probe, or a broadcast announcement).
    pub answer: bool,
    /// The probe's send time, ns (an answer echoes it).
    pub stamp_ns: u64,
    /// Frames the sender received on this path from the addressee.
    pub received: u64,
}

impl PathRepr {
    /// Decodes a PATH payload; unknown flag bits and a non-zero reserved field are refused.
    pub fn parse(payload: &[u8]) -> Result<Self> {
        if payload.len() < PATH_LEN {
            return Err(Error::Truncated { need: PATH_LEN, have: payload.len() });
        }
        if payload.len() > PATH_LEN {
            return Err(Error::Malformed { what: "path probe length" });
        }
        if payload[7] & !1 != 0 || payload[24..32].iter().any(|&b| b != 0) {
            return Err(Error::Malformed { what: "path probe flags" });
        }
        let mut node = [0u8; 6];
        node.copy_from_slice(&payload[..6]);
        let u64_at = |at: usize| u64::from_be_bytes(payload[at..at + 8].try_into().expect("8 bytes"));
        Ok(PathRepr {
            node: crate::MacAddr(node),
            port: payload[6],
            answer: payload[7] & 1 != 0,
            stamp_ns: u64_at(8),
            received: u64_at(16),
        })
    }

    /// Writes the payload into `buf` (at least [`PATH_LEN`] bytes).
    pub fn emit(&self, buf: &mut [u8]) {
        buf[..6].copy_from_slice(&self.node.0);
        buf[6] = self.port;
        buf[7] = u8::from(self.answer);
        buf[8..16].copy_from_slice(&self.stamp_ns.to_be_bytes());
        buf[16..24].copy_from_slice(&self.received.to_be_bytes());
        buf[24..32].fill(0);
    }
}

/// The fuzz target's body: decodes arbitrary bytes as an Ethernet frame carrying lanbus, walks
/// every structure inside, and checks that what parses emits back to the same bytes. Panics only
/// if such an invariant breaks.
#[cfg(any(test, fuzzing))]
pub fn fuzz_lanbus_frame(data: &[u8]) {
    let Ok(eth) = crate::EthernetFrame::new_checked(data) else { return };
    let Ok(packet) = Packet::new_checked(eth.payload()) else { return };
    let end = ETHERNET_HEADER_LEN + HEADER_LEN + usize::from(packet.payload_len());
    let _ = verify_checksum(&data[..end]);
    let Ok(repr) = Repr::parse(&packet) else { return };
    let mut out = [0u8; HEADER_LEN];
    let mut view = Packet::new_unchecked(&mut out[..]);
    repr.emit(&mut view);
    view.set_checksum(packet.checksum());
    let raw = &eth.payload()[..HEADER_LEN];
    // The reserved byte is emitted as zero; everything else must round-trip.
    let mut expect = [0u8; HEADER_LEN];
    expect.copy_from_slice(raw);
    expect[field::RESERVED0] = 0;
    assert_eq!(out, expect, "lanbus header does not round-trip");
    match repr.kind {
        Kind::Data => {
            let mut total = 0;
            for rec in Records::new(packet.payload()) {
                let Ok(rec) = rec else { break };
                total += rec.buffer_len();
                let mut buf = vec![0u8; rec.buffer_len()];
                rec.emit(&mut buf);
                let mut again = Records::new(&buf);
                assert_eq!(again.next(), Some(Ok(rec)));
            }
            assert!(total <= packet.payload().len());
        }
        Kind::Heartbeat => {
            if let Ok(hb) = HeartbeatRepr::parse(packet.payload()) {
                let mut buf = [0u8; HEARTBEAT_FIXED_LEN + MAX_NAME_LEN];
                let n = hb.emit(&mut buf);
                assert_eq!(&buf[..n], packet.payload(), "heartbeat does not round-trip");
            }
        }
        Kind::Ack => {
            let sack = Sack::parse(packet.payload());
            assert!(sack.as_bytes().len() <= packet.payload().len());
            assert_eq!(Sack::parse(sack.as_bytes()), sack, "SACK bitmap does not round-trip");
            let mut again = Sack::EMPTY;
            sack.iter().for_each(|i| again.set(i));
            assert_eq!(again, sack, "SACK indexes do not rebuild the bitmap");
        }
        Kind::Path => {
            if let Ok(p) = PathRepr::parse(packet.payload()) {
                let mut buf = [0u8; PATH_LEN];
                p.emit(&mut buf);
                assert_eq!(&buf[..], packet.payload(), "path probe does not round-trip");
            }
        }
        // Handshake messages are parsed (and fuzzed) by the authentication layer.
        Kind::Handshake | Kind::Unknown(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EtherType, EthernetFrame, EthernetRepr, MacAddr};

    #[test]
    fn a_path_probe_round_trips_and_bad_ones_are_refused() {
        let p = PathRepr {
            node: MacAddr([2, 0, 0, 0, 0, 9]),
            port: 1,
            answer: true,
            stamp_ns: 0x0102_0304_0506_0708,
            received: 77,
        };
        let mut buf = [0u8; PATH_LEN];
        p.emit(&mut buf);
        assert_eq!(&buf[..8], &[2, 0, 0, 0, 0, 9, 1, 1]);
        assert_eq!(PathRepr::parse(&buf), Ok(p));
        assert!(PathRepr::parse(&buf[..PATH_LEN - 1]).is_err(), "short");
        let mut long = [0u8; PATH_LEN + 1];
        long[..PATH_LEN].copy_from_slice(&buf);
        assert!(PathRepr::parse(&long).is_err(), "long");
        let mut flags = buf;
        flags[7] = 3;
        assert!(PathRepr::parse(&flags).is_err(), "unknown flag");
        let mut reserved = buf;
        reserved[30] = 1;
        assert!(PathRepr::parse(&reserved).is_err(), "reserved byte");
        assert_eq!(Kind::from(5), Kind::Path);
        assert_eq!(u8::from(Kind::Path), 5);
    }

    proptest::proptest! {
        #[test]
        fn path_probes_never_panic_and_what_parses_round_trips(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..48)) {
            if let Ok(p) = PathRepr::parse(&bytes) {
                let mut buf = [0u8; PATH_LEN];
                p.emit(&mut buf);
                proptest::prop_assert_eq!(&buf[..], &bytes[..]);
            }
        }
    }

    // DATA, flags ECHO, group 7, channel 3, seq 0xfffffffe, ack 0, ts 0x01020304, echo 0x0a0b0c0d,
    // epochs 0x11223344 (sender) and 0x55667788 (receiver), payload 7 bytes: one record (len 3,
    // FIRST|LAST, "abc").
    static DATA_HEADER: [u8; 40] = [
        0x02, 0x01, 0x02, 0x00, 0x00, 0x07, 0x00, 0x03, //
        0xff, 0xff, 0xff, 0xfe, 0x00, 0x00, 0x00, 0x00, //
        0x01, 0x02, 0x03, 0x04, 0x0a, 0x0b, 0x0c, 0x0d, //
        0x00, 0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, //
        0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88,
    ];
    static RECORD: [u8; 7] = [0x00, 0x03, 0x03, 0x00, b'a', b'b', b'c'];

    fn data_repr() -> Repr {
        Repr {
            kind: Kind::Data,
            flags: FLAG_ECHO,
            group: 7,
            channel: 3,
            sequence: 0xffff_fffe,
            ack: 0,
            timestamp: 0x0102_0304,
            echo: 0x0a0b_0c0d,
            payload_len: 7,
            hold_us: 0,
            epoch: 0x1122_3344,
            peer_epoch: 0x5566_7788,
        }
    }

    fn data_packet() -> Vec<u8> {
        let mut v = DATA_HEADER.to_vec();
        v.extend_from_slice(&RECORD);
        v
    }

    #[test]
    fn deconstruct() {
        let bytes = data_packet();
        let p = Packet::new_checked(&bytes[..]).unwrap();
        assert_eq!(p.version(), 2);
        assert_eq!(p.kind(), Kind::Data);
        assert_eq!(p.flags(), FLAG_ECHO);
        assert_eq!(p.group(), 7);
        assert_eq!(p.channel(), 3);
        assert_eq!(p.sequence(), 0xffff_fffe);
        assert_eq!(p.ack(), 0);
        assert_eq!(p.timestamp(), 0x0102_0304);
        assert_eq!(p.echo(), 0x0a0b_0c0d);
        assert_eq!(p.payload_len(), 7);
        assert_eq!((p.epoch(), p.peer_epoch()), (0x1122_3344, 0x5566_7788));
        assert_eq!(p.payload(), &RECORD);
        assert_eq!(Repr::parse(&p).unwrap(), data_repr());
        let recs: Vec<_> = Records::new(p.payload()).collect();
        assert_eq!(recs, vec![Ok(MessageRecord { flags: RECORD_FIRST | RECORD_LAST, data: b"abc" })]);
    }

    #[test]
    fn construct() {
        let mut buf = vec![0xaau8; 47];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        data_repr().emit(&mut p);
        let n = MessageRecord { flags: RECORD_FIRST | RECORD_LAST, data: b"abc" }.emit(p.payload_mut());
        assert_eq!(n, 7);
        assert_eq!(buf, data_packet());
    }

    // ACK from group 1 channel 0: ack 5, echo valid, held 0x1234 us, sender epoch 1, receiver's
    // not known yet.
    static ACK_HEADER: [u8; 40] = [
        0x02, 0x02, 0x02, 0x00, 0x00, 0x01, 0x00, 0x00, //
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x05, //
        0x00, 0x00, 0x00, 0x09, 0x00, 0x00, 0x00, 0x08, //
        0x00, 0x00, 0x12, 0x34, 0x00, 0x00, 0x00, 0x00, //
        0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00,
    ];

    #[test]
    fn ack_fixture() {
        let repr = Repr {
            kind: Kind::Ack,
            flags: FLAG_ECHO,
            group: 1,
            channel: 0,
            sequence: 0,
            ack: 5,
            timestamp: 9,
            echo: 8,
            payload_len: 0,
            hold_us: 0x1234,
            epoch: 1,
            peer_epoch: 0,
        };
        let p = Packet::new_checked(&ACK_HEADER[..]).unwrap();
        assert_eq!(Repr::parse(&p).unwrap(), repr);
        assert!(p.payload().is_empty());
        let mut out = [0u8; 40];
        repr.emit(&mut Packet::new_unchecked(&mut out[..]));
        assert_eq!(out, ACK_HEADER);
    }

    // Heartbeat payload: device, group 0x0102, 100000 us, name "io1".
    static HEARTBEAT: [u8; 11] = [0x02, 0x03, 0x01, 0x02, 0x00, 0x01, 0x86, 0xa0, b'i', b'o', b'1'];

    #[test]
    fn heartbeat_fixture() {
        let hb = HeartbeatRepr::parse(&HEARTBEAT).unwrap();
        let want = HeartbeatRepr { role: Role::Device, group: 0x0102, interval_us: 100_000, name: "io1" };
        assert_eq!(hb, want);
        let mut buf = [0u8; 72];
        let n = want.emit(&mut buf);
        assert_eq!(&buf[..n], &HEARTBEAT);
        assert_eq!(want.buffer_len(), 11);
        // Malformed: long name length, truncated, trailing bytes, bad UTF-8.
        let mut bad = HEARTBEAT;
        bad[1] = 65;
        assert_eq!(HeartbeatRepr::parse(&bad), Err(Error::Malformed { what: "heartbeat name length" }));
        assert_eq!(HeartbeatRepr::parse(&HEARTBEAT[..10]), Err(Error::Truncated { need: 11, have: 10 }));
        assert_eq!(HeartbeatRepr::parse(&HEARTBEAT[..5]), Err(Error::Truncated { need: 8, have: 5 }));
        let mut long = HEARTBEAT.to_vec();
        long.push(0);
        assert!(HeartbeatRepr::parse(&long).is_err());
        let mut utf = HEARTBEAT;
        utf[8] = 0xff;
        assert_eq!(HeartbeatRepr::parse(&utf), Err(Error::Malformed { what: "heartbeat name" }));
        // Long names are cut on a character boundary.
        let name = "é".repeat(40);
        let hb = HeartbeatRepr { role: Role::Host, group: 0, interval_us: 1, name: &name };
        let n = hb.emit(&mut buf);
        assert_eq!(HeartbeatRepr::parse(&buf[..n]).unwrap().name, "é".repeat(32));
    }

    #[test]
    fn truncated_and_malformed() {
        let bytes = data_packet();
        assert_eq!(Packet::new_checked(&bytes[..39]).unwrap_err(), Error::Truncated { need: 40, have: 39 });
        assert_eq!(Packet::new_checked(&bytes[..46]).unwrap_err(), Error::Truncated { need: 47, have: 46 });
        // Padding after the payload is allowed and ignored.
        let mut padded = bytes.clone();
        padded.extend_from_slice(&[0; 10]);
        assert_eq!(Packet::new_checked(&padded[..]).unwrap().payload(), &RECORD);
        let mut v1 = bytes.clone();
        v1[0] = 1;
        let p = Packet::new_checked(&v1[..]).unwrap();
        assert_eq!(Repr::parse(&p), Err(Error::Malformed { what: "lanbus version" }));
        let mut k = bytes.clone();
        k[1] = 9;
        assert_eq!(Repr::parse(&Packet::new_checked(&k[..]).unwrap()).unwrap().kind, Kind::Unknown(9));
        // Records: truncated header, overlong length, unknown flags.
        let r: Vec<_> = Records::new(&[0, 3, 3]).collect();
        assert_eq!(r, vec![Err(Error::Truncated { need: 4, have: 3 })]);
        let r: Vec<_> = Records::new(&[0, 9, 3, 0, 1, 2]).collect();
        assert_eq!(r, vec![Err(Error::Truncated { need: 13, have: 6 })]);
        let r: Vec<_> = Records::new(&[0, 0, 0x80, 0]).collect();
        assert_eq!(r, vec![Err(Error::Malformed { what: "message record flags" })]);
        let two = [0, 1, 1, 0, b'x', 0, 0, 2, 0];
        let r: Vec<_> = Records::new(&two).map(|r| r.unwrap()).collect();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].flags, r[0].data, r[1].flags, r[1].data), (1, &b"x"[..], 2, &b""[..]));
    }

    #[test]
    fn kind_and_role_codes_roundtrip() {
        for v in 0..=255u8 {
            assert_eq!(u8::from(Kind::from(v)), v);
            assert_eq!(u8::from(Role::from(v)), v);
        }
    }

    fn whole_frame() -> Vec<u8> {
        let mut f = vec![0u8; ETHERNET_HEADER_LEN];
        EthernetRepr {
            src_addr: MacAddr::local(1),
            dst_addr: MacAddr::local(2),
            ethertype: EtherType::Lanbus,
        }
        .emit(&mut EthernetFrame::new_unchecked(&mut f[..]));
        f.extend_from_slice(&data_packet());
        f
    }

    #[test]
    fn checksum_detects_every_single_bit_flip() {
        let mut f = whole_frame();
        fill_checksum(&mut f);
        assert!(verify_checksum(&f));
        assert_eq!(f[ETHERNET_HEADER_LEN + 2] & FLAG_CHECKSUM, FLAG_CHECKSUM);
        // The destination MAC (bits 0..48) is not covered: a tunnel may rewrite it.
        let mut g = f.clone();
        g[..6].copy_from_slice(&[0xff; 6]);
        assert!(verify_checksum(&g), "a rebuilt destination must not fail the checksum");
        for bit in 48..f.len() * 8 {
            let mut g = f.clone();
            g[bit / 8] ^= 1 << (bit % 8);
            assert!(!verify_checksum(&g), "flip of bit {bit} undetected");
        }
        assert!(!verify_checksum(&f[..f.len() - 1]));
    }

    #[test]
    fn checksum_of_a_frame_in_two_pieces_is_the_whole_frames() {
        let mut whole = whole_frame();
        whole.extend((0..9000u32).map(|i| (i * 7 + i / 251) as u8));
        let mut expected = whole.clone();
        fill_checksum(&mut expected);
        // Every split from just after the headers on, the lent piece long and short.
        for split in [CHECKSUM_FRAME_OFFSET + 4, whole_frame().len(), 100, 1000, whole.len() - 1, whole.len()]
        {
            let mut head = whole[..split].to_vec();
            fill_checksum_parts(&mut head, &whole[split..]);
            head.extend_from_slice(&whole[split..]);
            assert_eq!(head, expected, "split at {split}");
            assert!(verify_checksum(&head));
        }
    }

    #[test]
    fn checksum_fixture_from_an_independent_encoder() {
        // An ACK frame (02:4c:42:00:00:02 -> ...:01, group 7, channel 3, ack 0xffffffff, echo 1000,
        // epochs 0x0a0b0c0d and 0x01020304) encoded by a separate Python script (a bitwise
        // CRC-32C from RFC 3720's definition, checked against "123456789") from docs/wire.md's
        // description.
        let hex = "024c42000001024c4200000288b5020203000007000300000000ffffffff000007d0000003e8\
                   000000004fd36f220a0b0c0d01020304";
        let f: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        assert!(verify_checksum(&f));
        let p = Packet::new_checked(&f[ETHERNET_HEADER_LEN..]).unwrap();
        assert_eq!((p.kind(), p.group(), p.channel(), p.ack(), p.echo()), (Kind::Ack, 7, 3, u32::MAX, 1000));
        assert_eq!((p.epoch(), p.peer_epoch()), (0x0a0b_0c0d, 0x0102_0304));
        let mut again = f.clone();
        fill_checksum(&mut again);
        assert_eq!(again, f);
    }

    #[test]
    fn checksum_matches_a_bitwise_crc32c() {
        // Reference: the reflected CRC-32C, one bit at a time, over the frame with the field zero.
        fn bitwise(bytes: &[u8]) -> u32 {
            let mut crc = !0u32;
            for &b in bytes {
                crc ^= u32::from(b);
                for _ in 0..8 {
                    crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
                }
            }
            !crc
        }
        assert_eq!(bitwise(b"123456789"), 0xE306_9283, "the reference's own check value");
        for len in [CHECKSUM_FRAME_OFFSET + 4, 60, 61, 77, 1513, 1514, 9014] {
            let mut bytes: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            fill_checksum(&mut bytes);
            let mut zeroed = bytes.clone();
            zeroed[CHECKSUM_FRAME_OFFSET..CHECKSUM_FRAME_OFFSET + 4].fill(0);
            let field = &bytes[CHECKSUM_FRAME_OFFSET..CHECKSUM_FRAME_OFFSET + 4];
            assert_eq!(field, bitwise(&zeroed[6..]).to_be_bytes(), "len {len}");
            // The receiver's pass (field as sent) agrees, wherever the frame sits in memory; a
            // stale value in the field does not change what the sender writes.
            for shift in 0..8 {
                let mut at = vec![0xAA; shift];
                at.extend_from_slice(&bytes);
                assert!(verify_checksum(&at[shift..]), "len {len}, shift {shift}");
            }
            let mut stale = bytes.clone();
            stale[CHECKSUM_FRAME_OFFSET] ^= 0x5A;
            assert!(!verify_checksum(&stale));
            fill_checksum(&mut stale);
            assert_eq!(stale, bytes, "len {len}");
        }
    }

    #[test]
    fn checksum_detects_every_double_bit_flip_in_a_small_frame() {
        // The ones'-complement sum this replaced missed flips of the same bit in two words.
        let mut f = whole_frame();
        fill_checksum(&mut f);
        let bits = f.len() * 8;
        for a in 48..bits {
            for b in (a + 1..bits).step_by(7) {
                let mut g = f.clone();
                g[a / 8] ^= 1 << (a % 8);
                g[b / 8] ^= 1 << (b % 8);
                assert!(!verify_checksum(&g), "flips of bits {a} and {b} undetected");
            }
        }
    }

    #[test]
    fn fuzz_body_accepts_fixtures() {
        let mut f = whole_frame();
        fill_checksum(&mut f);
        fuzz_lanbus_frame(&f);
        fuzz_lanbus_frame(&f[..20]);
    }

    #[test]
    fn sack_bits_are_least_significant_first_and_trailing_zeros_are_cut() {
        let mut s = Sack::EMPTY;
        assert!(s.is_empty());
        s.set(0);
        s.set(9);
        s.set(SACK_MAX_FRAMES); // not reportable: ignored
        assert_eq!(s.as_bytes(), &[0x01, 0x02]);
        assert!(s.get(0) && s.get(9) && !s.get(1) && !s.get(SACK_MAX_FRAMES));
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0, 9]);
        assert_eq!(Sack::parse(&[0x01, 0x02, 0x00, 0x00]), s);
        assert_eq!(Sack::parse(&[0; 40]), Sack::EMPTY);
    }

    proptest::proptest! {
        #[test]
        fn sack_round_trips(indexes in proptest::collection::btree_set(0usize..SACK_MAX_FRAMES + 20, 0..40)) {
            let mut s = Sack::EMPTY;
            for &i in &indexes {
                s.set(i);
            }
            let reported: Vec<usize> = indexes.iter().copied().filter(|&i| i < SACK_MAX_FRAMES).collect();
            proptest::prop_assert_eq!(s.iter().collect::<Vec<_>>(), reported);
            proptest::prop_assert_eq!(Sack::parse(s.as_bytes()), s);
        }

        #[test]
        fn sack_parses_any_payload(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            let s = Sack::parse(&bytes);
            let n = bytes.len().min(SACK_MAX_FRAMES / 8);
            proptest::prop_assert!(bytes[..n].starts_with(s.as_bytes()));
            proptest::prop_assert!(bytes[s.as_bytes().len()..n].iter().all(|&b| b == 0));
        }

        #[test]
        fn checksum_in_two_pieces_is_the_whole_frames(
            body in proptest::collection::vec(proptest::num::u8::ANY, 0..3000),
            cut in 0usize..3000,
        ) {
            let mut whole = whole_frame();
            whole.extend_from_slice(&body);
            let split = (CHECKSUM_FRAME_OFFSET + 4 + cut).min(whole.len());
            let mut expected = whole.clone();
            fill_checksum(&mut expected);
            let mut head = whole[..split].to_vec();
            fill_checksum_parts(&mut head, &whole[split..]);
            proptest::prop_assert_eq!(&head[..], &expected[..split]);
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            fuzz_lanbus_frame(&bytes);
        }

        #[test]
        fn random_lanbus_headers_never_panic(
            body in proptest::collection::vec(proptest::num::u8::ANY, 0..120),
            version in 0u8..3, kind in 0u8..5,
        ) {
            let mut f = whole_frame();
            f.truncate(ETHERNET_HEADER_LEN);
            f.extend_from_slice(&body);
            if f.len() > ETHERNET_HEADER_LEN + 1 {
                f[ETHERNET_HEADER_LEN] = version;
                f[ETHERNET_HEADER_LEN + 1] = kind;
            }
            fuzz_lanbus_frame(&f);
        }
    }
}
