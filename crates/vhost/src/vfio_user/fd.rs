//! The descriptor plumbing of the vfio-user server: descriptors received with a message, the
//! seal that keeps mapped client memory from shrinking under the server, non-blocking eventfds.
//!
//! Layer: system calls under the server; the only unsafe code of the server.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::proto::MAX_FDS;

/// Reads up to `buf.len()` bytes and the descriptors that came with them; (0, []) at the end of
/// the stream.
pub(super) fn recv_with_fds(s: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Vec<File>)> {
    let mut raw = [-1 as RawFd; MAX_FDS];
    let mut iov = [libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() }];
    // SAFETY: the iovec points into `buf`, which lives and is not otherwise borrowed for the
    // call; the kernel writes at most `buf.len()` bytes there and at most MAX_FDS descriptors
    // into `raw`.
    let (n, count) = unsafe { s.recv_with_fds(&mut iov, &mut raw) }.map_err(io::Error::from)?;
    // SAFETY: the first `count` entries are descriptors the kernel just gave this process; each
    // is owned by exactly one File from here on.
    let fds = raw[..count.min(MAX_FDS)].iter().map(|&fd| unsafe { File::from_raw_fd(fd) }).collect();
    Ok((n, fds))
}

/// Makes sure the file cannot shrink while it is mapped (touching a page past its end would kill
/// the server with SIGBUS): it must already carry `F_SEAL_SHRINK` or accept it, as a memfd made
/// with `MFD_ALLOW_SEALING` does (QEMU's `memory-backend-memfd` seals its memory so).
pub(super) fn seal_against_shrinking(f: &File) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor this File owns; F_GET_SEALS takes no pointer.
    let seals = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GET_SEALS) };
    if seals >= 0 && seals & libc::F_SEAL_SHRINK != 0 {
        return Ok(());
    }
    // SAFETY: as above; F_ADD_SEALS takes an int.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } == 0 {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "memory that can shrink while mapped ({}): use a memfd that allows sealing",
        io::Error::last_os_error()
    )))
}

/// Whether `f` is an eventfd.
pub(super) fn is_eventfd(f: &File) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd()))
        .is_ok_and(|p| p.as_os_str() == "anon_inode:[eventfd]")
}

/// Sets `O_NONBLOCK` on the open file (shared with the client's copy of the descriptor).
pub(super) fn set_nonblocking(f: &File) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor this File owns; F_GETFL and F_SETFL take ints.
    let flags = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
