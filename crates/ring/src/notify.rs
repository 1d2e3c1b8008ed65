//! Eventfd notification, so an idle consumer can block instead of spinning.
//!
//! Layer: rings. The protocol (the same as virtio's event suppression and io_uring's
//! `IORING_SQ_NEED_WAKEUP`): the consumer stores "waiting" in shared memory, issues a SeqCst fence,
//! **re-checks** the ring, and only if still empty sleeps on the eventfd; the producer publishes,
//! issues a SeqCst fence, loads "waiting" and writes the eventfd only if set. With both fences, one
//! of the two loads sees the other side's store, so either the consumer finds the element on its
//! re-check or the producer sees the flag and wakes it: a wake-up is never missed, and a busy
//! producer makes no system call. `tests/loom.rs` checks this handshake. An eventfd's counter is
//! sticky (eventfd(2)): a notify that arrives before the consumer sleeps still wakes it.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

use crate::{Consumer, Error, Pod, Result};

/// A non-blocking eventfd used as a doorbell.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A new eventfd (non-blocking, close-on-exec).
    pub fn new() -> Result<EventFd> {
        // SAFETY: plain syscall; the result is checked.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(Error::io("eventfd", io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a fresh fd owned by nobody else.
        Ok(EventFd { fd: unsafe { OwnedFd::from_raw_fd(raw) } })
    }

    /// Wraps an eventfd received from a peer (over [`crate::recv_fds`]).
    pub fn from_fd(fd: OwnedFd) -> EventFd {
        EventFd { fd }
    }

    /// Rings the doorbell.
    pub fn notify(&self) -> Result<()> {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64.
        let n = unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if n == 8 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        // EAGAIN: the counter is at its maximum; the consumer will wake anyway.
        if e.kind() == io::ErrorKind::WouldBlock {
            Ok(())
        } else {
            Err(Error::io("eventfd write", e))
        }
    }

    /// Sleeps until the doorbell rang (then clears it) or `timeout` passed. Returns whether it rang.
    /// The timeout is kept to the microsecond (ppoll(2)): a 200 µs nap is a nap, not a poll that
    /// returns at once, as poll(2)'s whole milliseconds would make it.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<bool> {
        let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ts = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs().min(i32::MAX as u64) as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let tsp = ts.as_ref().map_or(core::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: one valid pollfd; `tsp` is null or points at a live timespec; no signal mask.
        let r = unsafe { libc::ppoll(&mut pfd, 1, tsp, core::ptr::null()) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(Error::io("poll eventfd", e));
        }
        if r == 0 {
            return Ok(false);
        }
        self.clear();
        Ok(true)
    }

    /// Clears the doorbell without waiting (one read(2); nothing to clear is fine).
    pub fn clear(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from a non-blocking eventfd. EAGAIN (nothing
        // rang, or another reader won) is fine.
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl<T: Pod> Consumer<T> {
    /// Blocks until the ring has an element (returns at once if it has), `timeout` passes or a
    /// spurious wake-up; the producer rings `doorbell` when [`crate::Producer::wake_needed`].
    pub fn wait(&mut self, doorbell: &EventFd, timeout: Option<Duration>) -> Result<()> {
        if !self.is_empty()? {
            return Ok(());
        }
        self.prepare_wait();
        // The re-check after arming: a producer that published before seeing our flag is caught here.
        let r = if self.is_empty()? { doorbell.wait(timeout).map(|_| ()) } else { Ok(()) };
        self.finish_wait();
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_nap_sleeps_its_time_and_a_ring_is_kept_until_cleared() {
        let bell = EventFd::new().unwrap();
        // Below a millisecond: poll(2) would have returned at once.
        let t = std::time::Instant::now();
        assert!(!bell.wait(Some(Duration::from_micros(300))).unwrap());
        assert!(t.elapsed() >= Duration::from_micros(300));
        bell.notify().unwrap();
        bell.notify().unwrap();
        assert!(bell.wait(Some(Duration::ZERO)).unwrap(), "a ring before the wait is kept");
        assert!(!bell.wait(Some(Duration::ZERO)).unwrap(), "and taken by it");
        bell.notify().unwrap();
        bell.clear();
        assert!(!bell.wait(Some(Duration::ZERO)).unwrap(), "cleared");
    }
}
