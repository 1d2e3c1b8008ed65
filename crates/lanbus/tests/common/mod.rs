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

/// A link in a network namespace taken down and up again, every `every` each way, until
/// [`Flapping::stop`].
pub struct Flapping {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u32>,
}

impl Flapping {
    /// Starts flapping `link` in the namespace named `netns`.
    pub fn start(netns: &str, link: &str, every: Duration) -> Flapping {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (flag, netns, link) = (stop.clone(), netns.to_string(), link.to_string());
        let thread = std::thread::spawn(move || {
            let mut flaps = 0;
            // Relaxed: a stop flag.
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                for state in ["down", "up"] {
                    std::thread::sleep(every);
                    let _ = Command::new("ip").args(["-n", &netns, "link", "set", &link, state]).status();
                }
                flaps += 1;
            }
            flaps
        });
        Flapping { stop, thread }
    }

    /// Stops (the link left up) and says how many times it went down and up.
    pub fn stop(self) -> u32 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("the flapping thread")
    }
}
