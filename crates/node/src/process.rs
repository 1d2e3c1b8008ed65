//! Waiting for SIGINT/SIGTERM in a daemon: the signals are blocked in every thread (the mask is
//! inherited by threads spawned afterwards) and taken synchronously with sigwait(2), so no
//! handler runs in signal context. And helper processes that end with the process that started
//! them ([`end_with_parent`]).
#![allow(unsafe_code)]

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Makes the process `command` starts receive SIGTERM when the thread that starts it ends,
/// which for a helper started by the main thread means when this process ends, however it ends
/// (SIGKILL included). For the helpers of a bench: qemu-nbd, fio, sockperf and iperf3.
pub fn end_with_parent(command: &mut Command) -> &mut Command {
    let parent = std::process::id();
    // SAFETY: the closure runs in the child between fork and exec and only calls prctl(2),
    // getppid(2) and _exit(2), which are async-signal-safe and touch no memory of ours.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have gone before the request took effect.
            if libc::getppid() as u32 != parent {
                libc::_exit(1);
            }
            Ok(())
        })
    }
}

/// SIGINT and SIGTERM, blocked in this thread and in threads it spawns from now on.
pub struct Blocked {
    set: libc::sigset_t,
}

impl Blocked {
    /// Blocks SIGINT and SIGTERM. Call before spawning threads.
    pub fn termination() -> std::io::Result<Blocked> {
        // SAFETY: sigset_t is plain data; sigemptyset initialises it before any other use.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a live sigset_t; the signal numbers are valid.
        unsafe {
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
        }
        // SAFETY: `set` is initialised; the old mask is not wanted (null is allowed).
        let r = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if r != 0 {
            return Err(std::io::Error::from_raw_os_error(r));
        }
        Ok(Blocked { set })
    }

    /// Waits for one of the signals; returns its number.
    pub fn wait(&self) -> i32 {
        let mut sig: libc::c_int = 0;
        // SAFETY: `self.set` is an initialised sigset_t and `sig` a live int.
        unsafe { libc::sigwait(&self.set, &mut sig) };
        sig
    }
}
