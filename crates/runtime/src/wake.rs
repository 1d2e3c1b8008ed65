//! Wake-ups for idle runtime threads: an eventfd, waited on together with a port's readiness
//! descriptor by poll(2).
//!
//! A thread that finds no work blocks in [`Waker::wait`]; any thread that gives it work calls
//! [`Waker::wake`] after publishing that work (under a mutex).
//!
//! A wake costs a write(2) only while the thread is parked (or about to park): `wake` raises
//! `pending` and writes the eventfd only if it then sees `parked`; `wait` raises `parked`, then
//! returns at once if it sees `pending`, and only otherwise polls. Both sides store their own
//! flag before loading the other's (SeqCst, a Dekker pair), so at least one of them sees the
//! other's: either the waiter skips the poll, or the waker writes the eventfd, whose counter makes
//! a poll that starts after the write return at once. No wake-up is lost, and a busy or spinning
//! thread is woken for free.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug)]
struct Inner {
    fd: OwnedFd,
    /// The waiting thread is in (or entering) poll(2).
    parked: AtomicBool,
    /// Work was published since the waiting thread last returned from `wait`.
    pending: AtomicBool,
}

/// An eventfd-based wake-up, shared by clones.
#[derive(Clone, Debug)]
pub(crate) struct Waker {
    inner: Arc<Inner>,
}

impl Waker {
    pub(crate) fn new() -> std::io::Result<Waker> {
        // SAFETY: eventfd has no memory preconditions; a negative return is an error.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a freshly created descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Waker {
            inner: Arc::new(Inner { fd, parked: AtomicBool::new(false), pending: AtomicBool::new(false) }),
        })
    }

    /// Makes the next (or current) `wait` return. A system call only if the thread is parked.
    pub(crate) fn wake(&self) {
        // SeqCst (both): this store and the load of `parked` below form one side of the Dekker
        // pair with `wait` (store `parked`, load `pending`); SeqCst forbids the store-load
        // reordering that would let both sides miss each other.
        self.inner.pending.store(true, Ordering::SeqCst);
        if self.inner.parked.load(Ordering::SeqCst) {
            self.write_eventfd();
        }
    }

    fn write_eventfd(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd. EAGAIN (counter saturated) means
        // a wake-up is pending already, which is all we want.
        unsafe { libc::write(self.inner.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Clears pending wake-ups.
    pub(crate) fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd.
        unsafe { libc::read(self.inner.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        // SeqCst: part of the same protocol as `wake`; the caller goes on to look for work.
        self.inner.pending.store(false, Ordering::SeqCst);
    }

    /// Blocks until woken, `port_fd` is readable, or `timeout` passes (`None`: no limit).
    pub(crate) fn wait(&self, port_fd: Option<RawFd>, timeout: Option<Duration>) {
        // SeqCst: the other side of the Dekker pair of `wake` (see the module comment).
        self.inner.parked.store(true, Ordering::SeqCst);
        if self.inner.pending.swap(false, Ordering::SeqCst) {
            // Work was published since the last wait: go and look at it.
            self.inner.parked.store(false, Ordering::SeqCst);
            return;
        }
        let mut fds = [
            libc::pollfd { fd: self.inner.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: port_fd.unwrap_or(-1), events: libc::POLLIN, revents: 0 },
        ];
        let n: libc::nfds_t = if port_fd.is_some() { 2 } else { 1 };
        // Round up so a timer due in 300 us does not become a 0 ms busy loop.
        let ms = timeout.map_or(-1, |t| t.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32);
        // SAFETY: `fds` is a live array of at least `n` pollfd structures.
        unsafe { libc::poll(fds.as_mut_ptr(), n, ms) };
        // SeqCst: as above. From here on wakes are free again; the caller looks for work next.
        self.inner.parked.store(false, Ordering::SeqCst);
        self.inner.pending.store(false, Ordering::SeqCst);
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
    fn wakes_while_not_parked_cost_no_write_but_are_seen() {
        let w = Waker::new().unwrap();
        w.wake();
        w.wake();
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from the test's non-blocking eventfd.
        let n = unsafe { libc::read(w.inner.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        assert_eq!(n, -1, "no eventfd write while nobody is parked");
        let t = std::time::Instant::now();
        w.wait(None, Some(Duration::from_secs(5)));
        assert!(t.elapsed() < Duration::from_secs(1), "the pending wake ends the next wait");
        let t = std::time::Instant::now();
        w.wait(None, Some(Duration::from_millis(20)));
        assert!(t.elapsed() >= Duration::from_millis(19), "consumed by the first wait");
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
