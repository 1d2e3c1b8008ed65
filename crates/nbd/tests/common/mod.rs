//! Shared test helpers: scratch directories, servers on Unix sockets and TCP, a gated device.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use lanbus_block::{BlockDevice, DeviceError, MemDevice};
use lanbus_nbd::{Export, Server};

/// A scratch directory removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("lanbus-nbd-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A server listening on a Unix socket (and optionally TCP loopback), shut down on drop.
pub struct TestServer {
    pub server: Server,
    pub socket: PathBuf,
    pub tcp: Option<SocketAddr>,
    pub scratch: Scratch,
}

impl TestServer {
    pub fn start(tag: &str, exports: Vec<Export>) -> TestServer {
        Self::start_with(tag, exports, |b| b)
    }

    pub fn start_with(
        tag: &str,
        exports: Vec<Export>,
        f: impl FnOnce(lanbus_nbd::ServerBuilder) -> lanbus_nbd::ServerBuilder,
    ) -> TestServer {
        let scratch = Scratch::new(tag);
        let socket = scratch.path("nbd.sock");
        let mut b = Server::builder();
        for e in exports {
            b = b.export(e);
        }
        let server = f(b).build().unwrap();
        server.serve(UnixListener::bind(&socket).unwrap()).unwrap();
        let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = tcp.local_addr().unwrap();
        server.serve(tcp).unwrap();
        TestServer { server, socket, tcp: Some(addr), scratch }
    }

    pub fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }

    pub fn tcp_uri(&self, export: &str) -> String {
        format!("nbd://{}/{export}", self.tcp.unwrap())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let _ = self.server.shutdown();
    }
}

pub fn mem_export(name: &str, size: u64) -> (Arc<MemDevice>, Export) {
    let dev = Arc::new(MemDevice::new(size));
    let export = Export::new(name, dev.clone() as Arc<dyn BlockDevice>);
    (dev, export)
}

/// Whether an executable is on PATH; prints why the caller skips when it is not.
pub fn have_tool(name: &str, package: &str) -> bool {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
        .unwrap_or(false);
    if !found {
        eprintln!("SKIP: `{name}` not installed (Debian package {package}; scripts/setup installs it)");
    }
    found
}

/// Runs a command, returns (success, stdout + stderr).
pub fn run(cmd: &mut std::process::Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// A RAM device whose reads at offset 0 wait until the gate opens, and which counts flushes.
pub struct GatedDevice {
    pub inner: MemDevice,
    open: Mutex<bool>,
    opened: Condvar,
    pub flushes: AtomicU64,
    pub blocked_reads: AtomicU64,
}

impl GatedDevice {
    pub fn new(size: u64) -> Self {
        GatedDevice {
            inner: MemDevice::new(size),
            open: Mutex::new(false),
            opened: Condvar::new(),
            flushes: AtomicU64::new(0),
            blocked_reads: AtomicU64::new(0),
        }
    }
    pub fn open_gate(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
    /// Waits until `n` reads are parked at the gate.
    pub fn wait_blocked(&self, n: u64) {
        let start = std::time::Instant::now();
        while self.blocked_reads.load(Ordering::SeqCst) < n {
            assert!(start.elapsed().as_secs() < 10, "reads never reached the gate");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

impl BlockDevice for GatedDevice {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        if offset == 0 {
            self.blocked_reads.fetch_add(1, Ordering::SeqCst);
            let mut open = self.open.lock().unwrap();
            while !*open {
                open = self.opened.wait(open).unwrap();
            }
        }
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        self.inner.write_at(offset, data, fua)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        self.inner.flush()
    }
}

pub fn read_all(dev: &dyn BlockDevice, offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    dev.read_at(offset, &mut v).unwrap();
    v
}

pub fn exists(p: &Path) -> bool {
    p.exists()
}

/// Submits `count` reads of 1 to `max_blocks` 512-byte blocks at random places of the region of
/// `model.len()` bytes from `base`, all in flight at once, and checks each reply against `model`
/// in whatever order they come back.
pub fn reads_match_model(
    c: &mut lanbus_nbd::Client,
    rng: &mut impl rand::Rng,
    base: u64,
    model: &[u8],
    count: usize,
    max_blocks: u64,
) {
    let region = model.len() as u64;
    let mut expect = std::collections::HashMap::new();
    for _ in 0..count {
        let len = 512 * rng.random_range(1..=max_blocks);
        let off = 512 * rng.random_range(0..(region - len) / 512);
        let h = c.submit(lanbus_nbd::proto::Command::Read, 0, base + off, len as u32, &[]).unwrap();
        expect.insert(h, model[off as usize..(off + len) as usize].to_vec());
    }
    while c.in_flight() > 0 {
        let d = c.complete().unwrap();
        assert_eq!(d.error, 0);
        assert!(expect.remove(&d.handle).unwrap() == d.data, "read mismatch");
    }
}
