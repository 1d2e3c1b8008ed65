//! What the daemon tests share: the binary under test, child processes that end with the test,
//! and checks of commands and installed programs. (Each test binary uses part of it.)
#![allow(dead_code)]

pub mod guest;

use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// The `lanbus` binary cargo built for these tests.
pub fn lanbus_path() -> &'static str {
    env!("CARGO_BIN_EXE_lanbus")
}

/// A child process ended when dropped: SIGTERM (the daemons clean up on it), then SIGKILL after
/// 5 s.
pub struct Daemon(pub Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A finished command's standard output; panics with its output if it failed.
pub fn ok(out: std::io::Result<Output>, what: &str) -> String {
    let out = out.unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether `program` is on the PATH.
pub fn have(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .is_ok_and(|o| o.status.success())
}
