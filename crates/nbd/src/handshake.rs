//! The fixed newstyle handshake, as a function over any byte reader and writer.
//!
//! Layer: protocol logic between the wire format ([`crate::proto`]) and the server's sockets. It
//! owns no socket and no thread, so the fuzzer and the tests run it over byte slices. The client's
//! option payloads are read into memory only up to [`MAX_OPTION_BYTES`]; anything the client sends
//! is distrusted (a broken option header ends the connection, a malformed payload gets
//! `NBD_REP_ERR_INVALID` and the haggling goes on).
//!
//! Spec: NBD `doc/proto.md`, "Fixed newstyle negotiation" and "Option types": `EXPORT_NAME`,
//! `ABORT`, `LIST`, `INFO`, `GO` are served; `STARTTLS`, `STRUCTURED_REPLY`, metadata contexts,
//! extended headers and any unknown option get `NBD_REP_ERR_UNSUP`.

use std::io::{self, Read, Write};

use crate::proto::*;

/// What the handshake needs to know about one export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// Export name (the first export is also the default, reached by the empty name).
    pub name: String,
    /// Optional description for `NBD_OPT_LIST` and `NBD_INFO_DESCRIPTION`.
    pub description: Option<String>,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Transmission flags (`TFLAG_*`).
    pub transmission_flags: u16,
    /// Minimum block size.
    pub min_block: u32,
    /// Preferred block size.
    pub preferred_block: u32,
    /// Maximum READ/WRITE payload.
    pub max_payload: u32,
}

/// How a handshake ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Transmission begins on the export at this index.
    Transmit(usize),
    /// The client sent `NBD_OPT_ABORT`.
    Aborted,
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The client broke the protocol.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// `NBD_OPT_EXPORT_NAME` named an export that does not exist (the spec says: disconnect).
    #[error("NBD_OPT_EXPORT_NAME for unknown export {0:?}")]
    UnknownExport(String),
    /// The client closed the connection between options (or before sending its flags): it left,
    /// which is not a protocol violation.
    #[error("client closed the connection during the handshake")]
    Closed,
    /// The socket failed or the client closed it in the middle of a message.
    #[error(transparent)]
    Io(#[from] io::Error),
}

fn find<'a>(exports: &'a [ExportInfo], name: &[u8]) -> Option<(usize, &'a ExportInfo)> {
    if name.is_empty() {
        return exports.first().map(|e| (0, e));
    }
    exports.iter().enumerate().find(|(_, e)| e.name.as_bytes() == name)
}

fn reply(w: &mut impl Write, option: u32, reply: u32, payload: &[u8]) -> io::Result<()> {
    let header = OptionReplyHeader { option, reply, length: payload.len() as u32 };
    let mut buf = Vec::with_capacity(OptionReplyHeader::LEN + payload.len());
    buf.extend_from_slice(&header.emit());
    buf.extend_from_slice(payload);
    w.write_all(&buf)
}

fn info_string(kind: u16, s: &str) -> Vec<u8> {
    let mut out = kind.to_be_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

/// Reads a whole message; end of stream before its first byte is [`HandshakeError::Closed`].
fn read_message(r: &mut impl Read, buf: &mut [u8]) -> Result<(), HandshakeError> {
    loop {
        match r.read(&mut buf[..1]) {
            Ok(0) => return Err(HandshakeError::Closed),
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        }
    }
    r.read_exact(&mut buf[1..])?;
    Ok(())
}

/// Runs the server's side of the handshake: greeting, client flags, then options until one
/// selects an export (`EXPORT_NAME` or a successful `GO`) or the client aborts. Writes are not
/// flushed: pass an unbuffered writer or flush it afterwards.
pub fn negotiate(
    r: &mut impl Read,
    w: &mut impl Write,
    exports: &[ExportInfo],
) -> Result<Outcome, HandshakeError> {
    w.write_all(&emit_greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))?;
    let mut flags = [0u8; 4];
    read_message(r, &mut flags)?;
    let client_flags = parse_client_flags(&flags)?;
    let no_zeroes = client_flags & CLIENT_FLAG_NO_ZEROES != 0;
    loop {
        let mut hb = [0u8; OptionHeader::LEN];
        read_message(r, &mut hb)?;
        let header = OptionHeader::parse(&hb)?;
        // Bounded by MAX_OPTION_BYTES in OptionHeader::parse.
        let mut payload = vec![0u8; header.length as usize];
        r.read_exact(&mut payload)?;
        let opt = header.option;
        match opt {
            OPT_EXPORT_NAME => {
                let Some((index, e)) = find(exports, &payload) else {
                    return Err(HandshakeError::UnknownExport(String::from_utf8_lossy(&payload).into()));
                };
                let mut out = Vec::with_capacity(10 + EXPORT_NAME_ZERO_PAD);
                out.extend_from_slice(&e.size_bytes.to_be_bytes());
                out.extend_from_slice(&e.transmission_flags.to_be_bytes());
                if !no_zeroes {
                    out.resize(10 + EXPORT_NAME_ZERO_PAD, 0);
                }
                w.write_all(&out)?;
                return Ok(Outcome::Transmit(index));
            }
            OPT_ABORT => {
                // The client may already have closed: a failed ACK changes nothing.
                let _ = reply(w, opt, REP_ACK, &[]);
                return Ok(Outcome::Aborted);
            }
            OPT_LIST => {
                if !payload.is_empty() {
                    reply(w, opt, REP_ERR_INVALID, b"NBD_OPT_LIST takes no data")?;
                    continue;
                }
                for e in exports {
                    let mut p = (e.name.len() as u32).to_be_bytes().to_vec();
                    p.extend_from_slice(e.name.as_bytes());
                    if let Some(d) = &e.description {
                        p.extend_from_slice(d.as_bytes());
                    }
                    reply(w, opt, REP_SERVER, &p)?;
                }
                reply(w, opt, REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => {
                let request = match parse_info_request(&payload) {
                    Ok(req) => req,
                    Err(InvalidOption(why)) => {
                        reply(w, opt, REP_ERR_INVALID, why.as_bytes())?;
                        continue;
                    }
                };
                let Some((index, e)) = find(exports, request.name) else {
                    let msg = format!("no export named {:?}", String::from_utf8_lossy(request.name));
                    reply(w, opt, REP_ERR_UNKNOWN, msg.as_bytes())?;
                    continue;
                };
                reply(w, opt, REP_INFO, &emit_info_export(e.size_bytes, e.transmission_flags))?;
                let mut sent_name = false;
                let mut sent_description = false;
                for &kind in &request.requests {
                    match kind {
                        INFO_NAME if !sent_name => {
                            reply(w, opt, REP_INFO, &info_string(INFO_NAME, &e.name))?;
                            sent_name = true;
                        }
                        INFO_DESCRIPTION if !sent_description => {
                            if let Some(d) = &e.description {
                                reply(w, opt, REP_INFO, &info_string(INFO_DESCRIPTION, d))?;
                            }
                            sent_description = true;
                        }
                        _ => {}
                    }
                }
                // Sent whether asked or not (the spec allows it): clients learn the alignment and
                // the 32 MiB payload limit this server enforces.
                let bs = emit_info_block_size(e.min_block, e.preferred_block, e.max_payload);
                reply(w, opt, REP_INFO, &bs)?;
                reply(w, opt, REP_ACK, &[])?;
                if opt == OPT_GO {
                    return Ok(Outcome::Transmit(index));
                }
            }
            _ => {
                let msg = format!("option {opt} is not supported by lanbus-nbd");
                reply(w, opt, REP_ERR_UNSUP, msg.as_bytes())?;
            }
        }
    }
}

/// Fuzz entry (target `nbd_handshake`): runs the whole server handshake over `data` as the
/// client's bytes. It must end with an outcome or an error, never a panic, and never write more
/// than a bounded amount per option.
#[cfg(any(test, fuzzing))]
pub fn fuzz_handshake(data: &[u8]) {
    let exports = [ExportInfo {
        name: "export".into(),
        description: Some("fuzz".into()),
        size_bytes: 1 << 20,
        transmission_flags: TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH,
        min_block: 512,
        preferred_block: 4096,
        max_payload: MAX_PAYLOAD_BYTES,
    }];
    let mut input = data;
    let mut out = Vec::new();
    let result = negotiate(&mut input, &mut out, &exports);
    if let Ok(Outcome::Transmit(i)) = result {
        assert_eq!(i, 0);
    }
    // Each option of at least 16 input bytes produces at most a few small replies.
    assert!(out.len() <= 18 + (data.len() / OptionHeader::LEN + 1) * 256);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exports() -> Vec<ExportInfo> {
        vec![
            ExportInfo {
                name: "export".into(),
                description: Some("RAM disk".into()),
                size_bytes: 1 << 20,
                transmission_flags: TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH,
                min_block: 512,
                preferred_block: 4096,
                max_payload: MAX_PAYLOAD_BYTES,
            },
            ExportInfo {
                name: "second".into(),
                description: None,
                size_bytes: 2 << 20,
                transmission_flags: TFLAG_HAS_FLAGS | TFLAG_READ_ONLY,
                min_block: 4096,
                preferred_block: 4096,
                max_payload: MAX_PAYLOAD_BYTES,
            },
        ]
    }

    fn option(opt: u32, payload: &[u8]) -> Vec<u8> {
        let mut v = OptionHeader { option: opt, length: payload.len() as u32 }.emit().to_vec();
        v.extend_from_slice(payload);
        v
    }

    /// Splits the server's output after the greeting into option replies.
    fn replies(out: &[u8]) -> (Vec<(OptionReplyHeader, Vec<u8>)>, Vec<u8>) {
        let mut rest = &out[18..];
        let mut v = Vec::new();
        while rest.len() >= 20 {
            let Ok(h) = OptionReplyHeader::parse(rest) else { break };
            v.push((h, rest[20..20 + h.length as usize].to_vec()));
            rest = &rest[20 + h.length as usize..];
        }
        (v, rest.to_vec())
    }

    fn run(input: &[u8]) -> (Result<Outcome, HandshakeError>, Vec<u8>) {
        let mut out = Vec::new();
        let mut r = input;
        let res = negotiate(&mut r, &mut out, &exports());
        (res, out)
    }

    #[test]
    fn list_info_go() {
        let mut input = vec![0, 0, 0, 3];
        input.extend(option(OPT_LIST, &[]));
        input.extend(option(OPT_STRUCTURED_REPLY, &[]));
        input.extend(option(OPT_INFO, &emit_info_request(b"second", &[INFO_NAME, INFO_DESCRIPTION])));
        input.extend(option(OPT_GO, &emit_info_request(b"", &[INFO_BLOCK_SIZE])));
        let (res, out) = run(&input);
        assert_eq!(res.unwrap(), Outcome::Transmit(0));
        let (r, rest) = replies(&out);
        assert!(rest.is_empty());
        let kinds: Vec<(u32, u32)> = r.iter().map(|(h, _)| (h.option, h.reply)).collect();
        assert_eq!(
            kinds,
            vec![
                (OPT_LIST, REP_SERVER),
                (OPT_LIST, REP_SERVER),
                (OPT_LIST, REP_ACK),
                (OPT_STRUCTURED_REPLY, REP_ERR_UNSUP),
                (OPT_INFO, REP_INFO),
                (OPT_INFO, REP_INFO),
                (OPT_INFO, REP_INFO),
                (OPT_INFO, REP_ACK),
                (OPT_GO, REP_INFO),
                (OPT_GO, REP_INFO),
                (OPT_GO, REP_ACK),
            ]
        );
        assert_eq!(r[0].1, b"\0\0\0\x06exportRAM disk");
        assert_eq!(r[1].1, b"\0\0\0\x06second");
        assert_eq!(r[4].1, emit_info_export(2 << 20, TFLAG_HAS_FLAGS | TFLAG_READ_ONLY));
        assert_eq!(r[5].1, b"\0\x01second");
        assert_eq!(r[6].1, emit_info_block_size(4096, 4096, MAX_PAYLOAD_BYTES), "no description: skipped");
        assert_eq!(r[8].1, emit_info_export(1 << 20, TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH));
    }

    #[test]
    fn export_name_with_and_without_zeroes() {
        let mut input = vec![0, 0, 0, 1];
        input.extend(option(OPT_EXPORT_NAME, b"second"));
        let (res, out) = run(&input);
        assert_eq!(res.unwrap(), Outcome::Transmit(1));
        assert_eq!(out.len(), 18 + 10 + 124);
        assert_eq!(&out[18..26], &(2u64 << 20).to_be_bytes());
        input[3] = 3;
        let (_, out) = run(&input);
        assert_eq!(out.len(), 18 + 10);
        let mut unknown = vec![0, 0, 0, 3];
        unknown.extend(option(OPT_EXPORT_NAME, b"nope"));
        assert!(matches!(run(&unknown).0, Err(HandshakeError::UnknownExport(_))));
    }

    #[test]
    fn errors_keep_the_haggling_going() {
        let mut input = vec![0, 0, 0, 3];
        input.extend(option(OPT_LIST, b"x"));
        input.extend(option(OPT_GO, b"\0\0"));
        input.extend(option(OPT_GO, &emit_info_request(b"missing", &[])));
        input.extend(option(999, b"whatever"));
        input.extend(option(OPT_ABORT, &[]));
        let (res, out) = run(&input);
        assert_eq!(res.unwrap(), Outcome::Aborted);
        let (r, _) = replies(&out);
        let kinds: Vec<u32> = r.iter().map(|(h, _)| h.reply).collect();
        assert_eq!(kinds, vec![REP_ERR_INVALID, REP_ERR_INVALID, REP_ERR_UNKNOWN, REP_ERR_UNSUP, REP_ACK]);
    }

    #[test]
    fn hostile_inputs_end_the_handshake() {
        assert!(matches!(run(&[0, 0, 0, 0]).0, Err(HandshakeError::Protocol(ProtocolError::ClientFlags(0)))));
        let mut bad_magic = vec![0, 0, 0, 3];
        bad_magic.extend_from_slice(&[0xff; 16]);
        assert!(matches!(run(&bad_magic).0, Err(HandshakeError::Protocol(ProtocolError::BadMagic { .. }))));
        let mut huge = vec![0, 0, 0, 3];
        huge.extend(OptionHeader { option: OPT_GO, length: u32::MAX }.emit());
        assert!(matches!(run(&huge).0, Err(HandshakeError::Protocol(ProtocolError::TooLong { .. }))));
        let mut truncated = vec![0, 0, 0, 3];
        truncated.extend(OptionHeader { option: OPT_GO, length: 100 }.emit());
        truncated.extend_from_slice(&[0; 10]);
        assert!(matches!(run(&truncated).0, Err(HandshakeError::Io(_))));
    }

    proptest::proptest! {
        #[test]
        fn random_handshake_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..300)) {
            fuzz_handshake(&bytes);
            let mut framed = vec![0, 0, 0, 3];
            framed.extend(&bytes);
            fuzz_handshake(&framed);
        }
    }
}
