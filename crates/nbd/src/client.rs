//! A small blocking NBD client: for the in-process tests, `lanbus demo` and benchmarks.
//!
//! Layer: beside the server, on the same wire format ([`crate::proto`]). It negotiates with
//! `NBD_OPT_GO` (asking for the block size and name), then sends requests and matches replies by
//! handle, so several requests may be in flight ([`Client::submit`] / [`Client::complete`]). The
//! server's bytes are checked like any peer's: bad magic or an unknown handle is an error, not a
//! panic.

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;

use crate::proto::*;
use crate::server::Stream;

/// Why a client operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The socket failed or the server closed it.
    #[error("NBD client I/O: {0}")]
    Io(#[from] io::Error),
    /// The server broke the protocol.
    #[error("NBD server broke the protocol: {0}")]
    Protocol(#[from] ProtocolError),
    /// The server refused an option.
    #[error("NBD option {option} refused with reply {reply:#x}: {message}")]
    Refused {
        /// The option.
        option: u32,
        /// The error reply (`REP_ERR_*`).
        reply: u32,
        /// The server's message.
        message: String,
    },
    /// A request failed with this error value.
    #[error("NBD request failed: {0}")]
    Request(Errno),
    /// A reply carried a handle that is not in flight.
    #[error("NBD reply for unknown handle {0}")]
    UnknownHandle(u64),
}

/// One completed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The handle [`Client::submit`] returned.
    pub handle: u64,
    /// 0 on success, else the error value.
    pub error: u32,
    /// The data of a successful READ (empty otherwise).
    pub data: Vec<u8>,
}

/// An export as `NBD_OPT_LIST` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedExport {
    /// Name.
    pub name: String,
    /// Description (the rest of the reply, possibly empty).
    pub description: String,
}

/// A connected client in the transmission phase.
pub struct Client {
    reader: BufReader<Stream>,
    writer: Stream,
    size_bytes: u64,
    transmission_flags: u16,
    block_sizes: Option<(u32, u32, u32)>,
    next_handle: u64,
    /// Handles in flight, with the byte count a READ will return.
    pending: HashMap<u64, u32>,
}

fn read_option_reply(r: &mut impl Read) -> Result<(OptionReplyHeader, Vec<u8>), ClientError> {
    let mut hb = [0u8; OptionReplyHeader::LEN];
    r.read_exact(&mut hb)?;
    let h = OptionReplyHeader::parse(&hb)?;
    if h.length > MAX_OPTION_BYTES {
        return Err(ProtocolError::TooLong {
            what: "option reply",
            len: h.length.into(),
            max: MAX_OPTION_BYTES.into(),
        }
        .into());
    }
    let mut payload = vec![0u8; h.length as usize];
    r.read_exact(&mut payload)?;
    Ok((h, payload))
}

fn greet(r: &mut impl Read, w: &mut impl Write) -> Result<(), ClientError> {
    let mut g = [0u8; 18];
    r.read_exact(&mut g)?;
    let magic = u64::from_be_bytes(g[0..8].try_into().expect("8 bytes"));
    let opt = u64::from_be_bytes(g[8..16].try_into().expect("8 bytes"));
    if magic != NBD_MAGIC || opt != IHAVEOPT {
        return Err(ProtocolError::BadMagic { what: "greeting", got: magic }.into());
    }
    let flags = u16::from_be_bytes([g[16], g[17]]);
    let mut cflags = CLIENT_FLAG_FIXED_NEWSTYLE;
    if flags & FLAG_NO_ZEROES != 0 {
        cflags |= CLIENT_FLAG_NO_ZEROES;
    }
    w.write_all(&cflags.to_be_bytes())?;
    Ok(())
}

fn send_option(w: &mut impl Write, option: u32, payload: &[u8]) -> io::Result<()> {
    let mut buf = OptionHeader { option, length: payload.len() as u32 }.emit().to_vec();
    buf.extend_from_slice(payload);
    w.write_all(&buf)
}

fn refused(h: &OptionReplyHeader, payload: &[u8]) -> ClientError {
    ClientError::Refused {
        option: h.option,
        reply: h.reply,
        message: String::from_utf8_lossy(payload).into_owned(),
    }
}

impl Client {
    /// Connects to a Unix socket and opens `export`.
    pub fn connect_unix(path: &Path, export: &str) -> Result<Client, ClientError> {
        Self::handshake(Stream::Unix(UnixStream::connect(path)?), export)
    }

    /// Connects over TCP and opens `export`.
    pub fn connect_tcp(addr: std::net::SocketAddr, export: &str) -> Result<Client, ClientError> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        Self::handshake(Stream::Tcp(s), export)
    }

    /// Lists the exports of the server at the Unix socket `path` (`NBD_OPT_LIST`, then `ABORT`).
    pub fn list_unix(path: &Path) -> Result<Vec<ListedExport>, ClientError> {
        let mut s = UnixStream::connect(path)?;
        let mut r = s.try_clone()?;
        greet(&mut r, &mut s)?;
        send_option(&mut s, OPT_LIST, &[])?;
        let mut out = Vec::new();
        loop {
            let (h, p) = read_option_reply(&mut r)?;
            match h.reply {
                REP_ACK => break,
                REP_SERVER if p.len() >= 4 => {
                    let n =
                        (u32::from_be_bytes(p[0..4].try_into().expect("4 bytes")) as usize).min(p.len() - 4);
                    out.push(ListedExport {
                        name: String::from_utf8_lossy(&p[4..4 + n]).into_owned(),
                        description: String::from_utf8_lossy(&p[4 + n..]).into_owned(),
                    });
                }
                _ => return Err(refused(&h, &p)),
            }
        }
        send_option(&mut s, OPT_ABORT, &[])?;
        // The server answers ABORT with an ACK; it may also just close.
        let _ = read_option_reply(&mut r);
        Ok(out)
    }

    /// Runs the handshake on a connected stream: `NBD_OPT_GO` for `export`, asking for the name
    /// and block sizes.
    pub fn handshake(stream: Stream, export: &str) -> Result<Client, ClientError> {
        let mut writer = stream.try_clone()?;
        let mut reader = BufReader::new(stream);
        greet(&mut reader, &mut writer)?;
        send_option(
            &mut writer,
            OPT_GO,
            &emit_info_request(export.as_bytes(), &[INFO_BLOCK_SIZE, INFO_NAME]),
        )?;
        let mut size_flags = None;
        let mut block_sizes = None;
        loop {
            let (h, p) = read_option_reply(&mut reader)?;
            if h.option != OPT_GO {
                return Err(refused(&h, &p));
            }
            match h.reply {
                REP_ACK => break,
                REP_INFO if p.len() >= 2 => match u16::from_be_bytes([p[0], p[1]]) {
                    INFO_EXPORT if p.len() == 12 => {
                        let size = u64::from_be_bytes(p[2..10].try_into().expect("8 bytes"));
                        size_flags = Some((size, u16::from_be_bytes([p[10], p[11]])));
                    }
                    INFO_BLOCK_SIZE if p.len() == 14 => {
                        let g = |i: usize| u32::from_be_bytes(p[i..i + 4].try_into().expect("4 bytes"));
                        block_sizes = Some((g(2), g(6), g(10)));
                    }
                    _ => {}
                },
                _ => return Err(refused(&h, &p)),
            }
        }
        let Some((size_bytes, transmission_flags)) = size_flags else {
            return Err(ProtocolError::Truncated { what: "NBD_INFO_EXPORT", need: 12, have: 0 }.into());
        };
        Ok(Client {
            reader,
            writer,
            size_bytes,
            transmission_flags,
            block_sizes,
            next_handle: 1,
            pending: HashMap::new(),
        })
    }

    /// Wraps a stream whose handshake is already done (for example by `NBD_OPT_EXPORT_NAME`).
    pub fn from_transmission(stream: Stream, size_bytes: u64, transmission_flags: u16) -> io::Result<Client> {
        Ok(Client {
            writer: stream.try_clone()?,
            reader: BufReader::new(stream),
            size_bytes,
            transmission_flags,
            block_sizes: None,
            next_handle: 1,
            pending: HashMap::new(),
        })
    }

    /// Export size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Transmission flags (`TFLAG_*`).
    pub fn transmission_flags(&self) -> u16 {
        self.transmission_flags
    }

    /// Minimum, preferred and maximum block sizes, if the server sent them.
    pub fn block_sizes(&self) -> Option<(u32, u32, u32)> {
        self.block_sizes
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Sends one request (with `payload` for WRITE) without waiting; returns its handle.
    pub fn submit(
        &mut self,
        command: Command,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Result<u64, ClientError> {
        let handle = self.next_handle;
        self.next_handle = self.next_handle.wrapping_add(1);
        let h = RequestHeader { flags, command, handle, offset, length };
        let mut buf = Vec::with_capacity(RequestHeader::LEN + payload.len());
        buf.extend_from_slice(&h.emit());
        buf.extend_from_slice(payload);
        self.writer.write_all(&buf)?;
        if command != Command::Disc {
            self.pending.insert(handle, if command == Command::Read { length } else { 0 });
        }
        Ok(handle)
    }

    /// Waits for the next reply, whichever request it answers.
    pub fn complete(&mut self) -> Result<Completion, ClientError> {
        let mut hb = [0u8; SimpleReply::LEN];
        self.reader.read_exact(&mut hb)?;
        let r = SimpleReply::parse(&hb)?;
        let Some(read_len) = self.pending.remove(&r.handle) else {
            return Err(ClientError::UnknownHandle(r.handle));
        };
        let mut data = Vec::new();
        if r.error == 0 && read_len > 0 {
            data = vec![0u8; read_len as usize];
            self.reader.read_exact(&mut data)?;
        }
        Ok(Completion { handle: r.handle, error: r.error, data })
    }

    fn call(
        &mut self,
        command: Command,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Result<Vec<u8>, ClientError> {
        let handle = self.submit(command, flags, offset, length, payload)?;
        loop {
            let c = self.complete()?;
            if c.handle == handle {
                return match c.error {
                    0 => Ok(c.data),
                    e => Err(ClientError::Request(Errno::from_u32(e))),
                };
            }
        }
    }

    /// Reads `buf.len()` bytes at `offset` (other replies arriving meanwhile are dropped).
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), ClientError> {
        let data = self.call(Command::Read, 0, offset, buf.len() as u32, &[])?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    /// Writes `data` at `offset`.
    pub fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), ClientError> {
        let flags = if fua { CMD_FLAG_FUA } else { 0 };
        self.call(Command::Write, flags, offset, data.len() as u32, data).map(drop)
    }

    /// Flushes.
    pub fn flush(&mut self) -> Result<(), ClientError> {
        self.call(Command::Flush, 0, 0, 0, &[]).map(drop)
    }

    /// Trims.
    pub fn trim(&mut self, offset: u64, length: u32) -> Result<(), ClientError> {
        self.call(Command::Trim, 0, offset, length, &[]).map(drop)
    }

    /// Writes zeroes (`no_hole` forbids deallocation).
    pub fn write_zeroes(&mut self, offset: u64, length: u32, no_hole: bool) -> Result<(), ClientError> {
        let flags = if no_hole { CMD_FLAG_NO_HOLE } else { 0 };
        self.call(Command::WriteZeroes, flags, offset, length, &[]).map(drop)
    }

    /// Waits for every request in flight, then sends `NBD_CMD_DISC` and closes.
    pub fn disconnect(mut self) -> Result<(), ClientError> {
        while !self.pending.is_empty() {
            self.complete()?;
        }
        self.submit(Command::Disc, 0, 0, 0, &[])?;
        let _ = self.writer.shutdown(std::net::Shutdown::Write);
        Ok(())
    }
}
