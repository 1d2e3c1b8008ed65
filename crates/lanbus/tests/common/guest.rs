//! A tiny Linux guest under QEMU for the VM tests: Debian's kernel and a busybox initramfs built
//! by `scripts/guest`, booted with TCG (or LANBUS_GUEST_ACCEL, e.g. `kvm` where it works) on
//! shared memory so vhost-user backends can reach it. The guest runs a workload script with the
//! boot's `lanbus.cmd=` arguments and powers off; its console is the test's evidence.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{have, Daemon};

/// Why the VM tests cannot run here, if they cannot: root, QEMU and a static busybox.
pub fn skip_reason() -> Option<String> {
    if let Err(s) = lanbus_port::netns::check_root() {
        return Some(s.to_string());
    }
    if !have("qemu-system-x86_64") {
        return Some(
            "skipped: needs qemu-system-x86_64 (Debian qemu-system-x86; scripts/setup installs it)".into(),
        );
    }
    let static_busybox = Command::new("sh")
        .args(["-c", "test -x /bin/busybox && ! ldd /bin/busybox >/dev/null 2>&1"])
        .status()
        .is_ok_and(|s| s.success());
    if !static_busybox {
        return Some(
            "skipped: needs a static /bin/busybox (Debian busybox-static; scripts/setup installs it)".into(),
        );
    }
    None
}

/// A built guest and the QEMU devices it boots with.
pub struct Guest {
    pub dir: PathBuf,
    /// QEMU arguments adding the devices under test.
    pub devices: Vec<String>,
    /// Guest memory, MiB.
    pub mem_mib: u32,
}

impl Guest {
    /// Builds the guest into `dir/guest` with `workload` as its script and `adds` (host file,
    /// path in the guest) copied in.
    pub fn build(dir: &Path, workload: &str, adds: &[(PathBuf, &str)], devices: Vec<String>) -> Guest {
        let script = dir.join("workload.sh");
        std::fs::write(&script, workload).unwrap();
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut c = Command::new(manifest.join("../../scripts/guest"));
        c.arg("build").arg(dir.join("guest")).arg("--workload").arg(&script);
        for (file, at) in adds {
            c.arg("--add").arg(format!("{}:{at}", file.display()));
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "scripts/guest: {}", String::from_utf8_lossy(&out.stderr));
        Guest { dir: dir.to_path_buf(), devices, mem_mib: 256 }
    }

    /// Starts QEMU running the workload with `cmd`; its console goes to `log`.
    pub fn qemu(&self, cmd: &str, log: &Path) -> Daemon {
        let accel = std::env::var("LANBUS_GUEST_ACCEL").unwrap_or_else(|_| "tcg".into());
        let out = std::fs::File::create(log).unwrap();
        let mut c = Command::new("qemu-system-x86_64");
        c.args(["-machine", "q35", "-smp", "2", "-nographic", "-no-reboot", "-nic", "none"]);
        c.args(["-m", &format!("{}M", self.mem_mib)]);
        for a in accel.split(',') {
            c.args(["-accel", a]);
        }
        c.args(["-object", &format!("memory-backend-memfd,id=mem,size={}M,share=on", self.mem_mib)])
            .args(["-numa", "node,memdev=mem"])
            .args(&self.devices)
            .arg("-kernel")
            .arg(self.dir.join("guest/vmlinuz"))
            .arg("-initrd")
            .arg(self.dir.join("guest/initramfs.cpio.gz"))
            .args(["-append", &format!("console=ttyS0 panic=-1 quiet lanbus.cmd={cmd}")]);
        Daemon(c.stdin(Stdio::null()).stdout(out.try_clone().unwrap()).stderr(out).spawn().expect("qemu"))
    }

    /// Boots a guest running `cmd` to its power-off (at most `limit`); its console output.
    pub fn boot(&self, cmd: &str, name: &str, limit: Duration) -> String {
        let log = self.dir.join(format!("{name}.log"));
        let mut q = self.qemu(cmd, &log);
        let t = Instant::now();
        let status = loop {
            if let Ok(Some(status)) = q.0.try_wait() {
                break status;
            }
            assert!(
                t.elapsed() < limit,
                "guest {name} did not power off in {limit:?}: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        let text = std::fs::read_to_string(&log).unwrap();
        eprintln!("guest {name} ({:.1} s, QEMU {status}):\n{text}", t.elapsed().as_secs_f64());
        text
    }
}
