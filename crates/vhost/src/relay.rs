//! A relay between a VMM and the vhost-user-net backend that makes QEMU's virtio-net and the
//! protocol crate agree on when rings may be enabled.
//!
//! QEMU's virtio-net (7.2 at least) sends `VHOST_USER_SET_VRING_ENABLE` as soon as it attaches
//! its peer, before `VHOST_USER_SET_FEATURES`; the protocol allows that message only once
//! `VHOST_USER_F_PROTOCOL_FEATURES` is negotiated, and the rust-vmm handler ends the connection
//! on it. Not offering the bit is no way out: QEMU then refuses to start vhost for the device
//! (and with MSI-X crashes). So the relay answers an enable that comes before the features
//! itself (an acknowledgement when one is asked for), remembers the state it asked for, and hands
//! it to the backend right after the features; everything else passes through unchanged, file
//! descriptors included.
//!
//! Layer: transport plumbing under [`crate::serve_net`]. The messages are framed by their
//! header (request, flags, payload size); a header that claims more than [`MAX_PAYLOAD`] bytes
//! ends the connection.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Header: request, flags, payload size (little-endian u32s).
const HEADER: usize = 12;
/// The largest payload relayed (the biggest vhost-user message, a memory table, is a few KiB).
pub(crate) const MAX_PAYLOAD: usize = 64 << 10;
/// Descriptors one message may carry (a memory table's regions).
const MAX_FDS: usize = 32;
const SET_FEATURES: u32 = 2;
const SET_VRING_ENABLE: u32 = 18;
/// `VHOST_USER_F_PROTOCOL_FEATURES` in `SET_FEATURES`.
const PROTOCOL_FEATURES: u64 = 1 << 30;
/// Flags: protocol version 1, a reply, a reply asked for.
const VERSION: u32 = 0x1;
const REPLY: u32 = 0x4;
const NEED_REPLY: u32 = 0x8;

/// One message: its bytes (header and payload) and the descriptors that came with it.
struct Message {
    bytes: Vec<u8>,
    fds: Vec<File>,
}

impl Message {
    fn word(&self, i: usize) -> u32 {
        u32::from_le_bytes(self.bytes[4 * i..4 * i + 4].try_into().unwrap_or_default())
    }
}

/// Reads a message; `None` at the end of the stream.
fn read_message(s: &UnixStream) -> io::Result<Option<Message>> {
    let mut bytes = vec![0u8; HEADER];
    let mut raw = [-1 as RawFd; MAX_FDS];
    let mut iov = [libc::iovec { iov_base: bytes.as_mut_ptr().cast(), iov_len: HEADER }];
    // SAFETY: the iovec points into `bytes`, which lives and is not otherwise borrowed for the
    // call; the kernel writes at most HEADER bytes there and at most MAX_FDS descriptors into
    // `raw`.
    let (n, count) = unsafe { s.recv_with_fds(&mut iov, &mut raw) }.map_err(io::Error::from)?;
    // SAFETY: the first `count` entries are descriptors the kernel just gave this process; each
    // is owned by exactly one File from here on.
    let fds = raw[..count.min(MAX_FDS)].iter().map(|&fd| unsafe { File::from_raw_fd(fd) }).collect();
    if n == 0 {
        return Ok(None);
    }
    (&*s).read_exact(&mut bytes[n..])?;
    let size = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
    if size > MAX_PAYLOAD {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a {size}-byte vhost-user message")));
    }
    bytes.resize(HEADER + size, 0);
    (&*s).read_exact(&mut bytes[HEADER..])?;
    Ok(Some(Message { bytes, fds }))
}

fn write_message(s: &UnixStream, m: &Message) -> io::Result<()> {
    let fds: Vec<RawFd> = m.fds.iter().map(AsRawFd::as_raw_fd).collect();
    let sent = if fds.is_empty() {
        (&*s).write(&m.bytes)?
    } else {
        s.send_with_fds(&[&m.bytes[..]], &fds).map_err(io::Error::from)?
    };
    (&*s).write_all(&m.bytes[sent..])
}

/// `SET_VRING_ENABLE` of `ring` to `state`, no reply asked for.
fn enable_message(ring: u32, state: u32) -> Message {
    let mut bytes = Vec::with_capacity(HEADER + 8);
    for w in [SET_VRING_ENABLE, VERSION, 8, ring, state] {
        bytes.extend_from_slice(&w.to_le_bytes());
    }
    Message { bytes, fds: Vec::new() }
}

/// Relays between `front` (the VMM) and `back` (the backend's end) until either closes; the two
/// threads end then.
pub(crate) fn start(front: UnixStream, back: UnixStream) -> io::Result<[JoinHandle<()>; 2]> {
    let to_front = Arc::new(Mutex::new(front.try_clone()?));
    let (front_r, back_w) = (front.try_clone()?, back.try_clone()?);
    let replies = to_front.clone();
    let forward = std::thread::Builder::new().name("vhost-net-relay".into()).spawn(move || {
        let mut features_set = false;
        // Ring enable states set before the features, by ring: replayed once they are set.
        let mut early: Vec<(u32, u32)> = Vec::new();
        let result = (|| -> io::Result<()> {
            while let Some(m) = read_message(&front_r)? {
                match m.word(0) {
                    SET_FEATURES if m.bytes.len() >= HEADER + 8 => {
                        features_set = true;
                        let value = u64::from(m.word(3)) | u64::from(m.word(4)) << 32;
                        write_message(&back_w, &m)?;
                        // Without the protocol-features bit the backend enables every ring itself.
                        if value & PROTOCOL_FEATURES != 0 {
                            for (ring, state) in early.drain(..) {
                                write_message(&back_w, &enable_message(ring, state))?;
                            }
                        }
                        early.clear();
                        continue;
                    }
                    SET_VRING_ENABLE if !features_set && m.bytes.len() >= HEADER + 8 => {
                        let (ring, state) = (m.word(3), m.word(4));
                        early.retain(|&(r, _)| r != ring);
                        early.push((ring, state));
                        if m.word(1) & NEED_REPLY != 0 {
                            let mut ack = Vec::with_capacity(HEADER + 8);
                            for w in [SET_VRING_ENABLE, VERSION | REPLY, 8] {
                                ack.extend_from_slice(&w.to_le_bytes());
                            }
                            ack.extend_from_slice(&0u64.to_le_bytes());
                            let f = replies.lock().unwrap_or_else(|e| e.into_inner());
                            write_message(&f, &Message { bytes: ack, fds: Vec::new() })?;
                        }
                        continue;
                    }
                    _ => {}
                }
                write_message(&back_w, &m)?;
            }
            Ok(())
        })();
        if let Err(e) = result {
            tracing::debug!("vhost-user-net relay, toward the backend: {e}");
        }
        let _ = back_w.shutdown(std::net::Shutdown::Both);
        let _ = front_r.shutdown(std::net::Shutdown::Both);
    })?;
    let backward = std::thread::Builder::new().name("vhost-net-relay".into()).spawn(move || {
        let result = (|| -> io::Result<()> {
            while let Some(m) = read_message(&back)? {
                let f = to_front.lock().unwrap_or_else(|e| e.into_inner());
                write_message(&f, &m)?;
            }
            Ok(())
        })();
        if let Err(e) = result {
            tracing::debug!("vhost-user-net relay, toward the VMM: {e}");
        }
        let _ = back.shutdown(std::net::Shutdown::Both);
        let _ = front.shutdown(std::net::Shutdown::Both);
    })?;
    Ok([forward, backward])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn message(request: u32, flags: u32, body: &[u8]) -> Vec<u8> {
        [&request.to_le_bytes()[..], &flags.to_le_bytes(), &(body.len() as u32).to_le_bytes(), body].concat()
    }

    /// Runs the relay on `input` from the VMM's side; what the backend's side received.
    fn through(input: &[u8]) -> Vec<u8> {
        let (vmm, front) = UnixStream::pair().unwrap();
        let (back, backend) = UnixStream::pair().unwrap();
        let threads = start(front, back).unwrap();
        (&vmm).write_all(input).unwrap();
        vmm.shutdown(std::net::Shutdown::Write).unwrap();
        let mut got = Vec::new();
        (&backend).read_to_end(&mut got).unwrap();
        drop(backend);
        for t in threads {
            t.join().unwrap();
        }
        got
    }

    #[test]
    fn an_early_enable_is_held_until_the_features_and_the_rest_passes_unchanged() {
        let enable = message(SET_VRING_ENABLE, VERSION, &[1, 0, 0, 0, 1, 0, 0, 0]);
        let features = message(SET_FEATURES, VERSION, &(PROTOCOL_FEATURES | 1 << 32).to_le_bytes());
        let get = message(1, VERSION, &[]);
        let got = through(&[get.clone(), enable.clone(), features.clone(), enable.clone()].concat());
        assert_eq!(got, [get, features, enable.clone(), enable.clone()].concat());
        // Features without the protocol bit: the backend enables its rings itself.
        let plain = message(SET_FEATURES, VERSION, &(1u64 << 32).to_le_bytes());
        assert_eq!(through(&[enable, plain.clone()].concat()), plain);
    }

    proptest! {
        /// Whatever the VMM sends, the relay forwards whole messages or stops; it never panics
        /// and never forwards more than it was given (held enables aside).
        #[test]
        fn any_bytes_from_the_vmm_end_the_relay_cleanly(
            msgs in proptest::collection::vec((0u32..40, any::<u32>(), proptest::collection::vec(any::<u8>(), 0..64)), 0..8),
            tail in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let mut input: Vec<u8> = msgs.iter().flat_map(|(r, f, b)| message(*r, *f, b)).collect();
            input.extend_from_slice(&tail);
            let got = through(&input);
            prop_assert!(got.len() <= input.len() + 8 * (HEADER + 8));
        }
    }
}
