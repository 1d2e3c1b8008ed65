//! Wake-ups for idle runtime threads: an eventfd, waited on together with a port's readiness
//! descriptor by poll(2).
//!
//! A thread that finds no work blocks in [`Waker::wait`]; any thread that gives it work calls
//! [`Waker::wake`] after publishing that work (under a mutex). The eventfd is a counter, so a wake
//! that happens between the worker's last check and its poll(2) is not lost: poll returns at once.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

/// An eventfd-based wake-up, shared by clones.
#[derive(Clone, Debug)]
pub(crate) struct Waker {
    fd: Arc<OwnedFd>,
}

impl Waker {
    pub(crate) fn new() -> std::io::Result<Waker> {
        // SAFETY: eventfd has no memory preconditions; a negative return is an error.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a freshly created descriptor that nothing else owns.
        Ok(Waker { fd: Arc::new(unsafe { OwnedFd::from_raw_fd(fd) }) })
    }

    /// Makes the next (or current) `wait` return.
    pub(crate) fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd. EAGAIN (counter saturated) means
        // a wake-up is pending already, which is all we want.
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Clears pending wake-ups.
    pub(crate) fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd.
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }

    /// Blocks until woken, `port_fd` is readable, or `timeout` passes (`None`: no limit).
    pub(crate) fn wait(&self, port_fd: Option<RawFd>, timeout: Option<Duration>) {
        let mut fds = [
            libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: port_fd.unwrap_or(-1), events: libc::POLLIN, revents: 0 },
        ];
        let n: libc::nfds_t = if port_fd.is_some() { 2 } else { 1 };
        // Round up so a timer due in 300 us does not become a 0 ms busy loop.
        let ms = timeout.map_or(-1, |t| t.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32);
        // SAFETY: `fds` is a live array of at least `n` pollfd structures.
        unsafe { libc::poll(fds.as_mut_ptr(), n, ms) };
        if fds[0].revents & libc::POLLIN != 0 {
            self.drain();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wake_before_the_wait_is_not_lost() {
        let w = Waker::new().unwrap();
        w.wake();
        let t = std::time::Instant::now();
        w.wait(None, Some(Duration::from_secs(5)));
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn wait_times_out_without_a_wake() {
        let w = Waker::new().unwrap();
        let t = std::time::Instant::now();
        w.wait(None, Some(Duration::from_millis(20)));
        assert!(t.elapsed() >= Duration::from_millis(19));
    }

    #[test]
    fn a_wake_from_another_thread_ends_the_wait() {
        let w = Waker::new().unwrap();
        let w2 = w.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            w2.wake();
        });
        let t = std::time::Instant::now();
        w.wait(None, Some(Duration::from_secs(10)));
        assert!(t.elapsed() < Duration::from_secs(5));
        h.join().unwrap();
    }
}
