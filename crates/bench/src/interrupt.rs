//! An interrupted bench cleans up after itself. A bench holds network namespaces, a scratch
//! directory (in /dev/shm, that is in memory: the NVMe bench's backing file is 256 MiB) and helper
//! servers (qemu-nbd, sockperf, iperf3). Their destructors remove them when the bench ends, but
//! SIGINT (Ctrl-C), SIGTERM and SIGHUP end a process without running destructors. [`install`]
//! takes those signals on a thread of its own, which removes the scratch directories registered
//! here and the namespaces this process made, then ends the process by the same signal with its
//! default action (so that a shell script running benches in a loop stops on Ctrl-C too); helper
//! servers are started with [`lanbus_node::process::end_with_parent`], so the kernel ends them when the
//! bench goes, however it goes.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};

use anyhow::Context;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

static DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn dirs() -> MutexGuard<'static, Vec<PathBuf>> {
    DIRS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Takes SIGINT, SIGTERM and SIGHUP from now on (once per process; later calls do nothing).
pub fn install() -> anyhow::Result<()> {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    if INSTALLED.get().is_some() {
        return Ok(());
    }
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .context("installing the bench's signal handlers")?;
    std::thread::Builder::new()
        .name("bench-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                // The registry stays locked until the process ends: nothing new gets registered
                // (and left behind) while this cleans up.
                let held = dirs();
                for dir in held.iter() {
                    let _ = std::fs::remove_dir_all(dir);
                }
                let namespaces = lanbus_port::netns::delete_all();
                // Not eprintln: after SIGHUP the terminal may be gone, and a failed write must
                // not keep the process from ending.
                let _ = writeln!(
                    std::io::stderr(),
                    "\nlanbus bench: interrupted (signal {sig}); removed network namespaces: {namespaces}, \
                     scratch directories: {}",
                    held.len()
                );
                // Ends the process by the signal (default action); returns only if that failed.
                let _ = signal_hook::low_level::emulate_default_handler(sig);
                std::process::exit(128 + sig);
            }
        })
        .context("starting the bench's signal thread")?;
    let _ = INSTALLED.set(());
    Ok(())
}

/// A bench's scratch directory, `lanbus-bench-NAME-PID` in /dev/shm (in memory, so files there
/// measure protocols, not a disk) or the temporary directory: removed on drop, or by the signal
/// thread if the bench is interrupted.
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// Creates the directory (and registers it).
    pub fn create(name: &str) -> anyhow::Result<ScratchDir> {
        let base =
            if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let path = base.join(format!("lanbus-bench-{name}-{}", std::process::id()));
        // Registered under the lock it is created under (see `install`).
        let mut held = dirs();
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        held.push(path.clone());
        Ok(ScratchDir { path })
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let mut held = dirs();
        let _ = std::fs::remove_dir_all(&self.path);
        held.retain(|d| *d != self.path);
    }
}

/// A helper process killed (and reaped) on drop.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
