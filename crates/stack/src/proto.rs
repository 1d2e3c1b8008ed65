//! The client protocol: messages between a program and the stack server.
//!
//! Layer: stack (client side and server side share it). Every message is a fixed 24-byte header
//! then, for the messages that carry bytes, the bytes:
//!
//! ```text
//!  0      1       2..4   4..8   8..16   16..20   20..22  22..24
//!  op     family  zero   a      b       ip4      port    zero
//! ```
//!
//! all little-endian but the address (network order, as on the wire). `family` is 0 for an IPv4
//! address (or none) and 6 for an IPv6 one, whose 16 bytes then follow the header (before any
//! payload) while `ip4` stays zero. `a` names a request, a
//! connection or a socket; `b` carries a count, an errno or a request id. Over shared memory one
//! message fills one pipe buffer; over a Unix socket (the baseline mode) each message is preceded
//! by its length as a u32.
//!
//! Invariants: [`Msg::parse`] never panics and accepts only what [`Msg::emit`] produces (ops it
//! knows, zero padding, payloads only where the op has one, within [`MAX_PAYLOAD`]); everything
//! else is [`ProtoError`], which the server answers by disconnecting the client.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

/// Bytes of the fixed header.
pub const HEADER_LEN: usize = 24;
/// The largest payload of one message: a copy unit of up to 1 MiB.
pub const MAX_PAYLOAD: usize = 1 << 20;

/// A message that does not parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// Shorter than the header.
    #[error("message of {0} bytes is shorter than the 24-byte header")]
    Short(usize),
    /// An op code this version does not know.
    #[error("unknown op {0}")]
    UnknownOp(u8),
    /// Padding that is not zero, or bytes after a message that carries none.
    #[error("op {0}: malformed (padding or a payload it does not carry)")]
    Malformed(u8),
    /// A payload longer than [`MAX_PAYLOAD`].
    #[error("payload of {0} bytes is longer than the limit")]
    TooLong(usize),
}

/// One message (a view: payloads borrow the buffer it was parsed from).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Msg<'a> {
    /// Client: open a TCP connection to `to`; answered by `Opened` or `Failed` with `req`.
    Connect {
        /// The request id the answer carries.
        req: u32,
        /// The remote address.
        to: SocketAddr,
    },
    /// Client: listen on TCP `port` (0: any free port) with `backlog` pending connections.
    Listen {
        /// The request id the answer carries.
        req: u32,
        /// The local port.
        port: u16,
        /// Connections that may wait to be accepted.
        backlog: u16,
    },
    /// Client: a UDP socket bound to `port` (0: any free port).
    UdpBind {
        /// The request id the answer carries.
        req: u32,
        /// The local port.
        port: u16,
    },
    /// Client: bytes to send on a connection (within the send credit).
    Send {
        /// The connection.
        conn: u32,
        /// The bytes.
        data: &'a [u8],
    },
    /// Client: the program read `bytes` more of a connection's data (receive credit returned).
    Consumed {
        /// The connection.
        conn: u32,
        /// How many bytes.
        bytes: u64,
    },
    /// Client: no more data will be sent (FIN after what is queued).
    Shutdown {
        /// The connection.
        conn: u32,
    },
    /// Client: the program is done with a connection, listener or UDP socket.
    Close {
        /// The handle.
        handle: u32,
    },
    /// Client: reset a connection now (RST).
    Abort {
        /// The connection.
        conn: u32,
    },
    /// Client: a datagram.
    UdpSend {
        /// The socket.
        sock: u32,
        /// Where to.
        to: SocketAddr,
        /// The bytes.
        data: &'a [u8],
    },
    /// Client: like `Connect`, but the connection's send buffer is shared memory the client
    /// writes into (zero copy; shared-memory channel only). Before the answer, the server passes
    /// the buffer's memfd over the Unix socket with the request id.
    ConnectZeroCopy {
        /// The request id the answer carries.
        req: u32,
        /// The remote address.
        to: SocketAddr,
    },
    /// Client: `bytes` bytes at `offset` of a zero-copy connection's send buffer are ready to send.
    Commit {
        /// The connection.
        conn: u32,
        /// Where in the send buffer they are.
        offset: u32,
        /// How many.
        bytes: u32,
    },
    /// Client: the program is about to fork: set aside one more reference to each of this
    /// client's connections, listeners and UDP sockets (zero-copy connections excepted) for the
    /// child, under a ticket; answered by `Ticket` with `req`.
    Fork {
        /// The request id the answer carries.
        req: u32,
    },
    /// Client: the fork of ticket `token` made process `pid` (0: the fork failed, and the ticket's
    /// references go). The server then frees the ticket when that process ends unclaimed.
    Forked {
        /// The ticket.
        token: u64,
        /// The child's process id, or 0.
        pid: u32,
    },
    /// Client (the forked child, attached anew): take over ticket `token`'s references; answered
    /// by `Opened` with the number of sockets as its handle, or `Failed` (EPERM: no such ticket).
    Adopt {
        /// The request id the answer carries.
        req: u32,
        /// The ticket.
        token: u64,
    },
    /// Client: this program is waiting on a socket it shares with other processes: send the
    /// connection's or UDP socket's arrivals here from now on, or one more of a listener's
    /// connections.
    Want {
        /// The handle.
        handle: u32,
    },
    /// Client: hold a connection's bytes back until a segment is full, the connection is shut
    /// down or closed, uncorked, or 200 ms passed (`TCP_CORK`, tcp(7)): a response and its FIN
    /// then leave together, as from Linux.
    Cork {
        /// The connection.
        conn: u32,
        /// Corked (`true`) or not.
        corked: bool,
    },
    /// Server: the answer to `Fork`: the ticket's secret, which only the child learns.
    Ticket {
        /// The request.
        req: u32,
        /// The ticket.
        token: u64,
    },
    /// Server: a request succeeded; `handle` names the new connection or socket.
    Opened {
        /// The request.
        req: u32,
        /// The new handle.
        handle: u32,
        /// The local address it got.
        local: SocketAddr,
    },
    /// Server: a request failed with `errno` (as Linux would give it).
    Failed {
        /// The request.
        req: u32,
        /// The errno.
        errno: i32,
    },
    /// Server: a listener has a new connection.
    Accepted {
        /// The listener.
        listener: u32,
        /// The new connection's handle.
        conn: u32,
        /// The remote address.
        peer: SocketAddr,
    },
    /// Server: bytes received on a connection (within the receive credit).
    Data {
        /// The connection.
        conn: u32,
        /// The bytes.
        data: &'a [u8],
    },
    /// Server: `bytes` more of the connection's data went into the stack (send credit returned).
    Sent {
        /// The connection.
        conn: u32,
        /// How many bytes.
        bytes: u64,
    },
    /// Server: the peer closed its side (FIN): no more data will come.
    Eof {
        /// The connection.
        conn: u32,
    },
    /// Server: the connection is gone: 0 after an orderly close, else the errno a read or write
    /// now gives (ECONNRESET, ETIMEDOUT, ECONNREFUSED, ...).
    Closed {
        /// The connection.
        conn: u32,
        /// The errno, or 0.
        errno: i32,
    },
    /// Server: a zero-copy connection's commits up to number `commits` (counted from 1, wrapping)
    /// are in the stack, and the next byte goes at `tail` of the send buffer.
    Placed {
        /// The connection.
        conn: u32,
        /// The last commit counted.
        commits: u32,
        /// The send buffer's next free position.
        tail: u32,
    },
    /// Server: a connection waits in a shared listener's backlog and this client has not asked
    /// for one: a process waiting on the listener should `Want` it (as every holder of a kernel
    /// listener sees it readable while its backlog has a connection).
    Pending {
        /// The listener.
        listener: u32,
    },
    /// Server: a datagram for a UDP socket.
    UdpData {
        /// The socket.
        sock: u32,
        /// Who sent it.
        from: SocketAddr,
        /// The bytes.
        data: &'a [u8],
    },
}

mod op {
    pub const CONNECT: u8 = 1;
    pub const LISTEN: u8 = 2;
    pub const UDP_BIND: u8 = 3;
    pub const SEND: u8 = 4;
    pub const CONSUMED: u8 = 5;
    pub const SHUTDOWN: u8 = 6;
    pub const CLOSE: u8 = 7;
    pub const ABORT: u8 = 8;
    pub const UDP_SEND: u8 = 9;
    pub const CONNECT_ZERO_COPY: u8 = 10;
    pub const COMMIT: u8 = 11;
    pub const FORK: u8 = 12;
    pub const FORKED: u8 = 13;
    pub const ADOPT: u8 = 14;
    pub const WANT: u8 = 15;
    pub const CORK: u8 = 16;
    pub const OPENED: u8 = 64;
    pub const FAILED: u8 = 65;
    pub const ACCEPTED: u8 = 66;
    pub const DATA: u8 = 67;
    pub const SENT: u8 = 68;
    pub const EOF: u8 = 69;
    pub const CLOSED: u8 = 70;
    pub const UDP_DATA: u8 = 71;
    pub const PLACED: u8 = 72;
    pub const TICKET: u8 = 73;
    pub const PENDING: u8 = 74;
}

const NOWHERE: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0));
/// The family byte of an IPv6 address.
const FAMILY_V6: u8 = 6;

impl<'a> Msg<'a> {
    /// The fields in header order: op, a, b, address, payload.
    fn parts(&self) -> (u8, u32, u64, SocketAddr, &'a [u8]) {
        use Msg::*;
        match *self {
            Connect { req, to } => (op::CONNECT, req, 0, to, &[]),
            Listen { req, port, backlog } => (op::LISTEN, req, u64::from(backlog), sock(port), &[]),
            UdpBind { req, port } => (op::UDP_BIND, req, 0, sock(port), &[]),
            Send { conn, data } => (op::SEND, conn, 0, NOWHERE, data),
            Consumed { conn, bytes } => (op::CONSUMED, conn, bytes, NOWHERE, &[]),
            Shutdown { conn } => (op::SHUTDOWN, conn, 0, NOWHERE, &[]),
            Close { handle } => (op::CLOSE, handle, 0, NOWHERE, &[]),
            Abort { conn } => (op::ABORT, conn, 0, NOWHERE, &[]),
            UdpSend { sock, to, data } => (op::UDP_SEND, sock, 0, to, data),
            ConnectZeroCopy { req, to } => (op::CONNECT_ZERO_COPY, req, 0, to, &[]),
            Commit { conn, offset, bytes } => (op::COMMIT, conn, pair(offset, bytes), NOWHERE, &[]),
            Fork { req } => (op::FORK, req, 0, NOWHERE, &[]),
            Forked { token, pid } => (op::FORKED, pid, token, NOWHERE, &[]),
            Adopt { req, token } => (op::ADOPT, req, token, NOWHERE, &[]),
            Want { handle } => (op::WANT, handle, 0, NOWHERE, &[]),
            Cork { conn, corked } => (op::CORK, conn, u64::from(corked), NOWHERE, &[]),
            Ticket { req, token } => (op::TICKET, req, token, NOWHERE, &[]),
            Pending { listener } => (op::PENDING, listener, 0, NOWHERE, &[]),
            Placed { conn, commits, tail } => (op::PLACED, conn, pair(commits, tail), NOWHERE, &[]),
            Opened { req, handle, local } => (op::OPENED, req, u64::from(handle), local, &[]),
            Failed { req, errno } => (op::FAILED, req, errno as u32 as u64, NOWHERE, &[]),
            Accepted { listener, conn, peer } => (op::ACCEPTED, listener, u64::from(conn), peer, &[]),
            Data { conn, data } => (op::DATA, conn, 0, NOWHERE, data),
            Sent { conn, bytes } => (op::SENT, conn, bytes, NOWHERE, &[]),
            Eof { conn } => (op::EOF, conn, 0, NOWHERE, &[]),
            Closed { conn, errno } => (op::CLOSED, conn, errno as u32 as u64, NOWHERE, &[]),
            UdpData { sock, from, data } => (op::UDP_DATA, sock, 0, from, data),
        }
    }

    /// Bytes [`Msg::emit`] writes.
    pub fn len(&self) -> usize {
        let (_, _, _, addr, data) = self.parts();
        HEADER_LEN + if addr.is_ipv6() { 16 } else { 0 } + data.len()
    }

    /// Whether the message is only a header (never: kept for the `len` convention).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Writes the message at the start of `buf`; returns its length, or `None` if `buf` is too
    /// short.
    pub fn emit(&self, buf: &mut [u8]) -> Option<usize> {
        let (code, a, b, addr, data) = self.parts();
        let len = self.len();
        let out = buf.get_mut(..len)?;
        out[..HEADER_LEN].fill(0);
        out[0] = code;
        out[4..8].copy_from_slice(&a.to_le_bytes());
        out[8..16].copy_from_slice(&b.to_le_bytes());
        out[20..22].copy_from_slice(&addr.port().to_be_bytes());
        let mut at = HEADER_LEN;
        match addr {
            SocketAddr::V4(v4) => out[16..20].copy_from_slice(&v4.ip().octets()),
            SocketAddr::V6(v6) => {
                out[1] = FAMILY_V6;
                out[at..at + 16].copy_from_slice(&v6.ip().octets());
                at += 16;
            }
        }
        out[at..].copy_from_slice(data);
        Some(len)
    }

    /// Parses one whole message (exactly `buf`).
    pub fn parse(buf: &'a [u8]) -> Result<Msg<'a>, ProtoError> {
        if buf.len() < HEADER_LEN {
            return Err(ProtoError::Short(buf.len()));
        }
        let code = buf[0];
        if buf[2..4] != [0; 2] || buf[22..24] != [0, 0] {
            return Err(ProtoError::Malformed(code));
        }
        let a = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes"));
        let b = u64::from_le_bytes(buf[8..16].try_into().expect("8 bytes"));
        let port = u16::from_be_bytes([buf[20], buf[21]]);
        let (addr, data) = match buf[1] {
            0 => {
                let ip = Ipv4Addr::new(buf[16], buf[17], buf[18], buf[19]);
                (SocketAddr::V4(SocketAddrV4::new(ip, port)), &buf[HEADER_LEN..])
            }
            FAMILY_V6 if buf[16..20] == [0; 4] && buf.len() >= HEADER_LEN + 16 => {
                let octets: [u8; 16] = buf[HEADER_LEN..HEADER_LEN + 16].try_into().expect("16 bytes");
                let ip = Ipv6Addr::from(octets);
                (SocketAddr::V6(SocketAddrV6::new(ip, port, 0, 0)), &buf[HEADER_LEN + 16..])
            }
            _ => return Err(ProtoError::Malformed(code)),
        };
        if data.len() > MAX_PAYLOAD {
            return Err(ProtoError::TooLong(data.len()));
        }
        let b32 = u32::try_from(b).map_err(|_| ProtoError::Malformed(code));
        let msg = match code {
            op::CONNECT => Msg::Connect { req: a, to: addr },
            op::LISTEN => Msg::Listen {
                req: a,
                port,
                backlog: u16::try_from(b).map_err(|_| ProtoError::Malformed(code))?,
            },
            op::UDP_BIND => Msg::UdpBind { req: a, port },
            op::SEND => Msg::Send { conn: a, data },
            op::CONSUMED => Msg::Consumed { conn: a, bytes: b },
            op::SHUTDOWN => Msg::Shutdown { conn: a },
            op::CLOSE => Msg::Close { handle: a },
            op::ABORT => Msg::Abort { conn: a },
            op::UDP_SEND => Msg::UdpSend { sock: a, to: addr, data },
            op::CONNECT_ZERO_COPY => Msg::ConnectZeroCopy { req: a, to: addr },
            op::COMMIT => Msg::Commit { conn: a, offset: b as u32, bytes: (b >> 32) as u32 },
            op::PLACED => Msg::Placed { conn: a, commits: b as u32, tail: (b >> 32) as u32 },
            op::FORK => Msg::Fork { req: a },
            op::FORKED => Msg::Forked { token: b, pid: a },
            op::ADOPT => Msg::Adopt { req: a, token: b },
            op::WANT => Msg::Want { handle: a },
            op::CORK => Msg::Cork { conn: a, corked: b == 1 },
            op::TICKET => Msg::Ticket { req: a, token: b },
            op::PENDING => Msg::Pending { listener: a },
            op::OPENED => Msg::Opened { req: a, handle: b32?, local: addr },
            op::FAILED => Msg::Failed { req: a, errno: b32? as i32 },
            op::ACCEPTED => Msg::Accepted { listener: a, conn: b32?, peer: addr },
            op::DATA => Msg::Data { conn: a, data },
            op::SENT => Msg::Sent { conn: a, bytes: b },
            op::EOF => Msg::Eof { conn: a },
            op::CLOSED => Msg::Closed { conn: a, errno: b32? as i32 },
            op::UDP_DATA => Msg::UdpData { sock: a, from: addr, data },
            other => return Err(ProtoError::UnknownOp(other)),
        };
        // Only the exact encoding is accepted: fields a message does not use must be zero.
        let (_, a2, b2, addr2, data2) = msg.parts();
        if a2 != a || b2 != b || addr2 != addr || data2.len() != data.len() {
            return Err(ProtoError::Malformed(code));
        }
        Ok(msg)
    }
}

/// Two 32-bit fields in the 64-bit one: `low` in the low half.
fn pair(low: u32, high: u32) -> u64 {
    u64::from(low) | u64::from(high) << 32
}

fn sock(port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port))
}

/// Fuzz entry: any bytes parse to a message or an error; what parses re-emits to the same bytes.
#[cfg(any(fuzzing, test))]
pub fn fuzz_parse(data: &[u8]) {
    if let Ok(msg) = Msg::parse(data) {
        let mut out = vec![0; msg.len()];
        assert_eq!(msg.emit(&mut out), Some(data.len()));
        assert_eq!(out, data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn addr() -> impl Strategy<Value = SocketAddr> {
        prop_oneof![
            (any::<[u8; 4]>(), any::<u16>()).prop_map(|(ip, port)| SocketAddr::new(ip.into(), port)),
            (any::<[u8; 16]>(), any::<u16>()).prop_map(|(ip, port)| SocketAddr::new(ip.into(), port)),
        ]
    }

    fn round_trip(msg: Msg<'_>) {
        let mut buf = vec![0; msg.len()];
        assert_eq!(msg.emit(&mut buf), Some(buf.len()));
        assert_eq!(Msg::parse(&buf), Ok(msg));
        assert_eq!(msg.emit(&mut buf[..msg.len() - 1]), None);
    }

    #[test]
    fn fixture_connect() {
        let msg = Msg::Connect { req: 7, to: "10.0.0.2:5201".parse().unwrap() };
        let mut buf = [0u8; HEADER_LEN];
        msg.emit(&mut buf).unwrap();
        assert_eq!(buf, [1, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10, 0, 0, 2, 0x14, 0x51, 0, 0]);
        assert_eq!(Msg::parse(&buf), Ok(msg));
    }

    #[test]
    fn fixture_connect_v6() {
        let msg = Msg::Connect { req: 7, to: "[fd00::2]:5201".parse().unwrap() };
        let mut buf = [0u8; HEADER_LEN + 16];
        assert_eq!(msg.len(), buf.len());
        msg.emit(&mut buf).unwrap();
        let mut want = [0u8; HEADER_LEN + 16];
        want[..HEADER_LEN]
            .copy_from_slice(&[1, 6, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x14, 0x51, 0, 0]);
        want[HEADER_LEN] = 0xfd;
        want[HEADER_LEN + 15] = 2;
        assert_eq!(buf, want);
        assert_eq!(Msg::parse(&buf), Ok(msg));
        // The family of a message without an address, an unknown family, a short address.
        let mut eof = [0u8; HEADER_LEN + 16];
        eof[0] = op::EOF;
        eof[1] = FAMILY_V6;
        assert_eq!(Msg::parse(&eof), Err(ProtoError::Malformed(op::EOF)));
        buf[1] = 4;
        assert_eq!(Msg::parse(&buf), Err(ProtoError::Malformed(op::CONNECT)));
        buf[1] = FAMILY_V6;
        assert_eq!(Msg::parse(&buf[..HEADER_LEN + 8]), Err(ProtoError::Malformed(op::CONNECT)));
    }

    #[test]
    fn rejects_what_emit_never_writes() {
        assert_eq!(Msg::parse(&[0; 10]), Err(ProtoError::Short(10)));
        let mut buf = [0u8; HEADER_LEN];
        buf[0] = 200;
        assert_eq!(Msg::parse(&buf), Err(ProtoError::UnknownOp(200)));
        buf[0] = op::SHUTDOWN;
        buf[2] = 1;
        assert_eq!(Msg::parse(&buf), Err(ProtoError::Malformed(op::SHUTDOWN)));
        buf[2] = 0;
        buf[9] = 1; // b is unused by SHUTDOWN
        assert_eq!(Msg::parse(&buf), Err(ProtoError::Malformed(op::SHUTDOWN)));
        let mut long = vec![0u8; HEADER_LEN + 3];
        long[0] = op::CLOSE; // CLOSE carries no payload
        assert_eq!(Msg::parse(&long), Err(ProtoError::Malformed(op::CLOSE)));
        let mut opened = [0u8; HEADER_LEN];
        opened[0] = op::OPENED;
        opened[12] = 1; // a handle above u32
        assert_eq!(Msg::parse(&opened), Err(ProtoError::Malformed(op::OPENED)));
    }

    #[test]
    fn fixture_fork_messages() {
        let token = 0x0807_0605_0403_0201u64;
        let mut buf = [0u8; HEADER_LEN];
        Msg::Adopt { req: 9, token }.emit(&mut buf).unwrap();
        assert_eq!(buf, [14, 0, 0, 0, 9, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Msg::parse(&buf), Ok(Msg::Adopt { req: 9, token }));
        Msg::Forked { token, pid: 4242 }.emit(&mut buf).unwrap();
        assert_eq!(buf[..8], [13, 0, 0, 0, 0x92, 0x10, 0, 0]);
        assert_eq!(Msg::parse(&buf), Ok(Msg::Forked { token, pid: 4242 }));
        Msg::Want { handle: 3 }.emit(&mut buf).unwrap();
        assert_eq!(buf, [15, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        // Fork and Want carry no count: a nonzero one is not what emit writes.
        buf[8] = 1;
        assert_eq!(Msg::parse(&buf), Err(ProtoError::Malformed(op::WANT)));
        buf[0] = op::FORK;
        assert_eq!(Msg::parse(&buf), Err(ProtoError::Malformed(op::FORK)));
    }

    #[test]
    fn fixture_cork() {
        let mut buf = [0u8; HEADER_LEN];
        Msg::Cork { conn: 5, corked: true }.emit(&mut buf).unwrap();
        assert_eq!(buf, [16, 0, 0, 0, 5, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Msg::parse(&buf), Ok(Msg::Cork { conn: 5, corked: true }));
        buf[8] = 0;
        assert_eq!(Msg::parse(&buf), Ok(Msg::Cork { conn: 5, corked: false }));
        // Corked is 0 or 1, nothing else.
        buf[8] = 2;
        assert_eq!(Msg::parse(&buf), Err(ProtoError::Malformed(op::CORK)));
    }

    proptest! {
        #[test]
        fn every_message_round_trips(
            a in any::<u32>(), b in any::<u64>(), e in any::<i32>(), port in any::<u16>(),
            backlog in any::<u16>(), to in addr(), data in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            let d = &data[..];
            for msg in [
                Msg::Connect { req: a, to },
                Msg::Listen { req: a, port, backlog },
                Msg::UdpBind { req: a, port },
                Msg::Send { conn: a, data: d },
                Msg::Consumed { conn: a, bytes: b },
                Msg::Shutdown { conn: a },
                Msg::Close { handle: a },
                Msg::Abort { conn: a },
                Msg::UdpSend { sock: a, to, data: d },
                Msg::Opened { req: a, handle: b as u32, local: to },
                Msg::Failed { req: a, errno: e },
                Msg::Accepted { listener: a, conn: b as u32, peer: to },
                Msg::Data { conn: a, data: d },
                Msg::Sent { conn: a, bytes: b },
                Msg::Eof { conn: a },
                Msg::Closed { conn: a, errno: e },
                Msg::UdpData { sock: a, from: to, data: d },
                Msg::ConnectZeroCopy { req: a, to },
                Msg::Commit { conn: a, offset: b as u32, bytes: (b >> 32) as u32 },
                Msg::Placed { conn: a, commits: (b >> 7) as u32, tail: (b >> 40) as u32 },
                Msg::Fork { req: a },
                Msg::Forked { token: b, pid: a },
                Msg::Adopt { req: a, token: b },
                Msg::Want { handle: a },
                Msg::Cork { conn: a, corked: b % 2 == 1 },
                Msg::Ticket { req: a, token: b },
                Msg::Pending { listener: a },
            ] {
                round_trip(msg);
            }
        }

        #[test]
        fn any_bytes_parse_or_fail_cleanly(data in proptest::collection::vec(any::<u8>(), 0..80)) {
            fuzz_parse(&data);
        }

        #[test]
        fn headers_with_a_known_op_parse_or_fail_cleanly(
            code in prop::sample::select(vec![
                1u8, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74,
            ]),
            rest in proptest::collection::vec(prop::sample::select(vec![0u8, 0, 0, 1, 255]), 23..40),
        ) {
            let mut data = vec![code];
            data.extend(rest);
            fuzz_parse(&data);
        }
    }
}
