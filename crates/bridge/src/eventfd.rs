//! A Linux eventfd: the descriptor an MSI-X vector is delivered to, so a user can poll(2) it
//! along with its other descriptors, or block on it.
//!
//! Layer: pcie engine, host side; the only unsafe code of this crate (three libc calls).
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// An eventfd counter: [`signal`](Self::signal) adds one, [`take`](Self::take) reads and clears.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A new, non-blocking eventfd.
    pub fn new() -> std::io::Result<EventFd> {
        // SAFETY: eventfd has no memory preconditions; a negative return is an error.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor nothing else owns.
        Ok(EventFd { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// An eventfd someone else made (a VMM's, passed over a socket). It should be non-blocking:
    /// [`signal`](Self::signal) would otherwise block while its counter is at its maximum.
    pub fn from_owned(fd: OwnedFd) -> EventFd {
        EventFd { fd }
    }

    /// The descriptor (readable while the counter is not zero).
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Adds one to the counter.
    pub fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd; EAGAIN (saturated) is harmless.
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Reads and clears the counter: the number of signals since the last take (0 if none).
    pub fn take(&self) -> u64 {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        if n == 8 {
            v
        } else {
            0
        }
    }

    /// Waits until the counter is not zero or `timeout` passes, then takes it.
    pub fn wait(&self, timeout: Duration) -> u64 {
        let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        // SAFETY: `pfd` is one live pollfd.
        unsafe { libc::poll(&mut pfd, 1, ms) };
        self.take()
    }
}
