//! `lanbus bench nvme`: the paper's Fig. 6. fio (`--ioengine=nbd`, random read and random write,
//! numjobs=1, iodepth=1, block sizes 4 KiB .. 1 MiB; `--iodepth` and `--numjobs` for deeper queues
//! and several connections, whose figures are the jobs' sum) against the NVMe namespace exported
//! over NBD:
//!
//! - `local`: the controller model in-process (driver and controller joined directly, the
//!   controller on its own thread as on the device bridge), behind the NBD server: no fabric;
//! - `peer:qemu-nbd`: qemu-nbd serving the same backing file on a local Unix socket (no network:
//!   the reference without any link);
//! - `peer:nbd-tcp`: the socket path a user would otherwise deploy: qemu-nbd in one network
//!   namespace serving the same backing file over TCP, fio in the other, across the same veth at
//!   the same MTU as the lanbus rows, or at its own (`--peer-mtu`) (root). Every lanbus row's
//!   `ratio_vs_nbd_tcp` compares it with this row;
//! - `sim`: the whole fabric (device bridge, transport, host bridge, driver) over the in-process
//!   simulated wire;
//! - `udp`, `afpacket`, `afxdp`: the fabric over real ports: over a veth pair between two network
//!   namespaces when root (afpacket and afxdp need it), `udp` over loopback otherwise.
//!
//! Every row serves the same backing file (`--size-mib`, filled with data, in /dev/shm when it
//! exists): the lanbus rows' controller reads and writes it with pread/pwrite, as qemu-nbd does
//! (writeback cache, no O_DIRECT, for both). Every row runs the same fio job. Metrics `mb_per_s`
//! and `iops`, with `block_size`, `rw`, (lanbus rows) the driver's `completion` mode and (rows over
//! the veth) its `mtu`, 9000 by default (the drive's TLPs carry up to 4 KiB; `--mtu 1500,9000` runs
//! those rows at each, `--peer-mtu` sets the peer's apart); each the median of the runs (`--runs`,
//! 3 of 2 s, or 1 of 1 s with `--quick`), which go in turns: every row once, then every row again;
//! at 4 KiB also `p99_us`, the 99th percentile of fio's completion latency. After each port's rows,
//! its floor: `raw:PORT` (`mb_per_s_one_way`), the bare port's one-way bandwidth in frames of the
//! link's MTU, the same ports opened the same way with nothing above them. Every figure also
//! carries the CPU it cost, in seconds per GB moved: `client_cpu_s_per_gb` (fio, from its own
//! accounting) and `server_cpu_s_per_gb` (qemu-nbd for the peers; for the lanbus rows this process,
//! which holds both bridges, the driver, the controller and the NBD server: both ends of the link).
//! Each after an unmeasured warm-up run per direction with blocks twice the largest measured (see
//! [`warm_up`]). A PNG per direction (MB/s against block size) next to the JSON. At depth 1 each
//! lanbus row also splits a request's time (with one job) into stages (`stage_us`, microseconds per
//! request, from counters the NBD server, the driver and the backing store keep):
//! `client_and_socket` (fio and the Unix socket: fio's time per request less the server's stages),
//! `nbd_payload` (reading a WRITE's data from the socket), `driver_copy` (the driver copying data
//! between the request and DMA memory: for a write into the drive's memory buffer, across the
//! fabric), `fabric_and_device` (the driver waiting for its commands: bridges, transport, port and
//! controller, less the backing store), `backing` (pread/pwrite of the backing file) and
//! `nbd_reply` (sending the reply, a READ's data included). The stages overlap a little (a reply is
//! read while it is sent), so the first is clamped at zero. A write the NBD server gives the drive
//! in pieces as its payload arrives (into the memory buffer, above 256 KiB) overlaps more: the
//! driver's and the drive's stages start while its later pieces are still read from the socket.
//! Every lanbus row also counts the copies of its data (`copies_per_byte`, at every depth: bytes
//! copied per byte the NBD server moved, from byte counters kept where the data crosses from one
//! part to the next), per stage in the order a write's data passes them: `socket` (fio's copy
//! into or out of the Unix socket and the server's, two per byte), `driver` (the driver's copies
//! into and out of its DMA memory in host memory), `into_frames` (the transports copying messages
//! into frames, both nodes; bytes lent to the frames are not copied), `port` (the kernel's copies
//! of every frame sent and received, both nodes, headers and acknowledgements included: into its
//! buffer on sending, into the receiver's ring on receiving), `out_of_frames` (the
//! transports' copies while delivering, and the bridges' copies of received payloads: a device's
//! writes into host memory, read completions into their read's buffer, requests queued for the
//! drive's worker), `controller` (the host's writes into the memory buffer, a command's data into
//! the controller's buffer where it is not written from where it lay, its copies out of and into
//! the memory buffer; in the `local` row, whose controller reaches host memory by plain copies,
//! its writes to host memory too) and `backing` (pread/pwrite, each a copy to or from the page
//! cache), and `all` for their sum. The frames' checksums read each byte the ports copy once more
//! on each side. The TCP peer's copies are not counted: by construction they are fio's copy into
//! the socket, qemu-nbd's out of it and its pwrite (reads the other way), three per byte (its
//! segments cross the veth without a copy).
//! `--cmb on,off` measures each lanbus row
//! with the driver's queues, PRP lists and write data in the drive's Controller Memory Buffer and
//! in host memory (the `cmb` parameter; both compare with the same `peer:nbd-tcp` figures). With
//! `LANBUS_BENCH_DEBUG` set in the environment, each fabric row ends by printing its bridges' and
//! transports' counters (retransmissions, RTTs, DMA).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::Args;
use lanbus_block::{BlockDevice, FileDevice};
use lanbus_nbd::{Export, Server};

use super::interrupt::{KillOnDrop, ScratchDir};
use lanbus_node::process::end_with_parent;
use lanbus_nvme::local::{LocalNvme, ProcessMode};
use lanbus_port::Port;

use super::nbd::run_fio;
use super::report::{median, Report, Row};
use crate::plot::{write_png, Plot, Series};
use lanbus_node::drive::{self, NvmeBacking, NvmeBlock};
use lanbus_node::fabric::SimFabric;
use lanbus_port::netns::{Netns, VethPair};

/// `lanbus bench nvme` options.
#[derive(Debug, Args)]
pub struct NvmeBenchArgs {
    /// Write the common JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the plots as PREFIX-randread.png and PREFIX-randwrite.png.
    #[arg(long, default_value = "bench-nvme")]
    png: String,
    /// One 1-second fio run per point instead of three of 2 seconds.
    #[arg(long)]
    quick: bool,
    /// fio runs per point, of 2 seconds each; a figure is their median (default 3, 1 with
    /// --quick). Runs go in turns: every row once, then every row again.
    #[arg(long)]
    runs: Option<usize>,
    /// Namespace size in MiB (the backing file every row serves).
    #[arg(long, default_value_t = 256)]
    size_mib: u64,
    /// Rows to measure (comma-separated); default all that can run here.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Block sizes to measure (comma-separated, fio syntax); default the paper's 4k..1m.
    #[arg(long, value_delimiter = ',')]
    block_sizes: Vec<String>,
    /// Directions to measure (comma-separated); default both.
    #[arg(long, value_delimiter = ',', value_parser = ["randread", "randwrite"])]
    rw: Vec<String>,
    /// How the lanbus rows' NVMe driver learns of completions: `poll` (poll the completion
    /// queue briefly, then sleep on MSI-X; what the host daemon uses) or `interrupt`.
    #[arg(long, default_value = "poll", value_parser = ["poll", "interrupt"])]
    completion: String,
    /// Whether the lanbus rows' driver uses the drive's Controller Memory Buffer: `on` (its
    /// submission queues, PRP lists and write data in the drive's memory, reached with posted
    /// writes; what the host daemon does) or `off` (all of them in host memory, where Linux's
    /// own nvme driver puts them: the drive then reads each command and each write's data
    /// across the fabric, a round trip each). Comma-separated for both in one run.
    #[arg(long, value_delimiter = ',', default_value = "on", value_parser = ["on", "off"])]
    cmb: Vec<String>,
    /// MTUs of the veth pair the udp, afpacket, afxdp and peer:nbd-tcp rows cross
    /// (comma-separated: those rows run at each, and each figure names its MTU). The default is
    /// the usual jumbo frame (an AF_XDP frame then takes three 4 KiB UMEM frames: multi-buffer
    /// AF_XDP, Linux 6.6+); 3500 is the largest that fits one, 1500 is plain Ethernet; a veth
    /// takes up to 65000 here.
    #[arg(long, value_delimiter = ',', default_value = "9000")]
    mtu: Vec<u32>,
    /// MTUs of the veth for the `peer:nbd-tcp` row alone (comma-separated; default the same as
    /// `--mtu`): the kernel's TCP path at its usual MTUs while the lanbus rows also run at their
    /// best, e.g. `--mtu 9000,65000 --peer-mtu 9000`. A lanbus row's `ratio_vs_nbd_tcp` compares
    /// it with the peer at the same MTU, or, where the peer did not run at that MTU, with the peer
    /// at each MTU it ran at; each ratio names the peer's MTU (`peer_mtu`).
    #[arg(long, value_delimiter = ',')]
    peer_mtu: Vec<u32>,
    /// fio I/O depths to measure (comma-separated); the paper's is 1. Deeper queues show how the
    /// fabric scales with outstanding I/O (the driver's queue pairs, the fabric's channels).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    iodepth: Vec<u32>,
    /// fio jobs to measure (comma-separated), each with a connection of its own to the NBD
    /// server (the lanbus rows' driver spreads them over its queue pairs); the paper's is 1.
    /// Figures are the jobs' sum.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    numjobs: Vec<u32>,
    /// The keyed fabric's settings for the rows over a fabric (comma-separated, measured in
    /// turns): `off` (no key), `auth` (every frame authenticated under a key of this run) or
    /// `encrypt` (and its payload encrypted). With `auth` or `encrypt`, `crypto:` rows give the
    /// AEAD's own rate per core on 64 KiB frames.
    #[arg(long, value_delimiter = ',', default_value = "off", value_parser = ["off", "auth", "encrypt"])]
    security: Vec<String>,
}

impl NvmeBenchArgs {
    /// Every MTU the veth is set to: `--mtu`, then those of `--peer-mtu` not among them.
    fn mtus(&self) -> Vec<u32> {
        let mut all = self.mtu.clone();
        all.extend(self.peer_mtu.iter().filter(|m| !self.mtu.contains(m)));
        all
    }

    /// Whether row `name`, which crosses the veth, runs with the veth at `mtu`.
    fn runs_at(&self, name: &str, mtu: u32) -> bool {
        if name == "peer:nbd-tcp" && !self.peer_mtu.is_empty() {
            self.peer_mtu.contains(&mtu)
        } else {
            self.mtu.contains(&mtu)
        }
    }

    /// The fio directions to measure (`--rw`, default both).
    fn directions(&self) -> impl Iterator<Item = &'static str> + '_ {
        ["randread", "randwrite"]
            .into_iter()
            .filter(|rw| self.rw.is_empty() || self.rw.iter().any(|r| r == rw))
    }

    fn driver_config(&self, cmb: &str) -> lanbus_nvme::DriverConfig {
        let completion = match self.completion.as_str() {
            "interrupt" => lanbus_nvme::CompletionMode::Interrupt,
            _ => lanbus_nvme::CompletionMode::Poll,
        };
        lanbus_nvme::DriverConfig { completion, use_cmb: cmb == "on", ..drive::driver_config() }
    }
}

const BLOCK_SIZES: [&str; 5] = ["4k", "16k", "64k", "256k", "1m"];

/// CPU seconds process `pid` has used so far (user and system, from /proc), if it can be read.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks / hz as f64)
}

/// What keeps one target alive while fio runs against it.
enum Holder {
    Local(Timing, LocalNvme, Server),
    Fabric(Timing, SimFabric, Server),
    Qemu(KillOnDrop),
}

/// Where a lanbus row's time counters are.
struct Timing {
    driver: Arc<lanbus_nvme::NvmeDriver>,
    backing: Arc<lanbus_nvme::backing::BackingTime>,
}

/// The time counters of a lanbus row at one moment (nanoseconds, and NBD requests served), and
/// its byte counters: the data the NBD server moved and the bytes copied at each of
/// [`COPY_STAGES`].
#[derive(Debug, Clone, Copy, Default)]
struct Stamps {
    requests: u64,
    payload_ns: u64,
    device_ns: u64,
    reply_ns: u64,
    io_ns: u64,
    copy_ns: u64,
    backing_ns: u64,
    data_bytes: u64,
    copied: [u64; 7],
}

/// Where a lanbus row copies its bytes (`copies_per_byte` rows), in the order a write's data
/// passes them; see the module's documentation.
const COPY_STAGES: [&str; 7] =
    ["socket", "driver", "into_frames", "port", "out_of_frames", "controller", "backing"];

/// The stages a request's time is split into (`stage_us` rows), in the order a read passes them.
const STAGES: [&str; 6] =
    ["client_and_socket", "nbd_payload", "driver_copy", "fabric_and_device", "backing", "nbd_reply"];

impl Holder {
    fn stamps(&self) -> Option<Stamps> {
        let (t, server) = match self {
            Holder::Local(t, _, s) | Holder::Fabric(t, _, s) => (t, s),
            Holder::Qemu(_) => return None,
        };
        let n = server.stats();
        let d = t.driver.stats();
        // Relaxed: statistics, read as a snapshot.
        let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        let data_bytes = n.bytes_read + n.bytes_written;
        // The fabric's nodes: what their transports copied into and out of frames, and what
        // their ports handed to the kernel and took from it.
        let (mut into_frames, mut port, mut out_of_frames) = (0, 0, 0);
        let controller = match self {
            Holder::Fabric(_, f, _) => {
                let nodes = std::iter::once(f.host.runtime_stats())
                    .chain(f.device.as_ref().map(|d| d.runtime_stats()));
                for r in nodes {
                    let c = r.transport;
                    into_frames += c.bytes_sent.saturating_sub(c.bytes_lent);
                    port += r.port.tx_bytes + r.port.rx_bytes;
                    out_of_frames += c.bytes_copied_on_delivery;
                }
                out_of_frames += f.host.stats().payload_bytes_copied;
                out_of_frames += f.device.as_ref().map_or(0, |d| d.stats().payload_bytes_copied);
                f.controller_stats.get().0.bytes_copied
            }
            Holder::Local(_, nvme, _) => {
                // In-process DMA: the controller's writes to host memory are copies too.
                let c = nvme.controller().stats();
                c.bytes_copied + c.bytes_read
            }
            Holder::Qemu(_) => 0,
        };
        Some(Stamps {
            requests: n.requests_read + n.requests_write,
            payload_ns: n.payload_ns,
            device_ns: n.device_ns,
            reply_ns: n.reply_ns,
            io_ns: get(&d.io_ns),
            copy_ns: get(&d.copy_ns),
            backing_ns: t.backing.read_ns() + t.backing.write_ns(),
            data_bytes,
            copied: [
                2 * data_bytes,
                get(&d.copy_bytes),
                into_frames,
                port,
                out_of_frames,
                controller,
                t.backing.bytes(),
            ],
        })
    }
}

impl Stamps {
    /// Bytes copied per byte of the client's data at each of [`COPY_STAGES`] between `self` and
    /// the later `after`.
    fn copies_per_byte(&self, after: &Stamps) -> Option<[f64; 7]> {
        let data = after.data_bytes.checked_sub(self.data_bytes).filter(|&n| n > 0)? as f64;
        Some(std::array::from_fn(|i| after.copied[i].saturating_sub(self.copied[i]) as f64 / data))
    }

    /// Microseconds per request in each of [`STAGES`] between `self` and the later `after`, for
    /// requests of `total_us` each (fio's time per request at depth 1).
    fn per_request(&self, after: &Stamps, total_us: f64) -> Option<[f64; 6]> {
        let n = after.requests.checked_sub(self.requests).filter(|&n| n > 0)? as f64;
        let us = |a: u64, b: u64| a.saturating_sub(b) as f64 / 1e3 / n;
        let (payload, device, reply) = (
            us(after.payload_ns, self.payload_ns),
            us(after.device_ns, self.device_ns),
            us(after.reply_ns, self.reply_ns),
        );
        let (io, copy, backing) = (
            us(after.io_ns, self.io_ns),
            us(after.copy_ns, self.copy_ns),
            us(after.backing_ns, self.backing_ns),
        );
        Some([
            (total_us - payload - device - reply).max(0.0),
            payload,
            copy,
            (io - copy - backing).max(0.0),
            backing,
            reply,
        ])
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        // Stop the NBD server (requests finished, flushed) before its drive goes.
        let server = match self {
            Holder::Local(_, _, s) | Holder::Fabric(_, _, s) => s,
            Holder::Qemu(child) => {
                let _ = child.0.kill();
                return;
            }
        };
        if let Err(e) = server.shutdown() {
            eprintln!("bench nvme: stopping an NBD server: {e}");
        }
        if let Holder::Fabric(_, f, _) = self {
            if std::env::var_os("LANBUS_BENCH_DEBUG").is_some() {
                eprintln!("host {:?}\nhost runtime {:?}", f.host.stats(), f.host.runtime_stats());
                if let Some(d) = &f.device {
                    eprintln!("device {:?}\ndevice runtime {:?}", d.stats(), d.runtime_stats());
                }
                eprintln!("driver cmb {:?} interrupts {:?}", f.driver.cmb_in_use(), f.driver.stats());
            }
            let _ = f.driver.shutdown();
        }
        if let Holder::Local(_, n, _) = self {
            let _ = n.controller().stats();
        }
    }
}

fn serve(dir: &Path, name: &str, device: Arc<dyn BlockDevice>) -> anyhow::Result<(Server, String)> {
    let socket = dir.join(format!("{name}.sock"));
    // The same row's socket from an earlier run (its server has stopped).
    let _ = std::fs::remove_file(&socket);
    let server = Server::builder().export(Export::new("nvme0", device)).build()?;
    server.serve(std::os::unix::net::UnixListener::bind(&socket)?)?;
    Ok((server, format!("nbd+unix:///nvme0?socket={}", socket.display())))
}

/// The backing file all rows serve.
fn backing(dir: &Path) -> NvmeBacking {
    NvmeBacking::File { path: dir.join("backing.img"), size: None }
}

fn local(dir: &Path, dcfg: lanbus_nvme::DriverConfig) -> anyhow::Result<(Holder, String)> {
    let (ctrl, backing) = drive::controller_timed(&backing(dir), 512)?;
    let nvme = LocalNvme::new(ctrl, drive::DMA_REGION_PAGES, ProcessMode::Thread);
    let driver = Arc::new(nvme.driver(dcfg)?);
    let (server, uri) = serve(dir, "local", Arc::new(NvmeBlock::new(driver.clone())))?;
    Ok((Holder::Local(Timing { driver, backing }, nvme, server), uri))
}

fn over(
    dir: &Path,
    name: &str,
    ports: (Box<dyn Port>, Box<dyn Port>),
    dcfg: lanbus_nvme::DriverConfig,
) -> anyhow::Result<(Holder, String)> {
    let (ctrl, backing) = drive::controller_timed(&backing(dir), 512)?;
    let f = SimFabric::over_with(ctrl, ports.0, ports.1, dcfg)?;
    let (server, uri) = serve(dir, name, Arc::new(NvmeBlock::new(f.driver.clone())))?;
    let timing = Timing { driver: f.driver.clone(), backing };
    Ok((Holder::Fabric(timing, f, server), uri))
}

/// One unmeasured fio run per direction with blocks of `bytes` (twice the largest measured), so
/// that every row serves every size in its steady state, whatever order the sizes are measured
/// in. qemu-nbd takes each request's buffer from glibc (aligned allocations), which maps a buffer
/// at or above its mmap threshold afresh on every request (page faults on all of it) until
/// freeing a larger one raises the threshold: measured, qemu-nbd served 256 KiB writes at 1360
/// MB/s before any 1 MiB request and at 2268 after (reads 1212 and 2000), and 1 MiB reads at
/// 1440 until a 4 MiB request had gone by, 2130 after. A long-running server has seen large
/// requests; a fresh one has not. The lanbus rows (mimalloc, buffers reused) show no such step.
fn warm_up(ns: Option<&Netns>, uri: &str, args: &NvmeBenchArgs, bytes: u64) -> anyhow::Result<()> {
    let bs = bytes.to_string();
    for rw in args.directions() {
        run_fio(ns, uri, rw, &bs, 1, 1, args.size_mib, 1)
            .with_context(|| format!("warming up with {rw} of {bs} bytes"))?;
    }
    Ok(())
}

/// Creates the backing file: real blocks (not a sparse file), so every row reads allocated data.
fn create_backing(dir: &Path, size: u64) -> anyhow::Result<()> {
    let dev = FileDevice::create(&dir.join("backing.img"), size)?;
    let chunk: Vec<u8> = (0..1 << 20).map(|i| (i * 31 + 7) as u8).collect();
    for off in (0..size).step_by(chunk.len()) {
        dev.write_at(off, &chunk[..chunk.len().min((size - off) as usize)], false)?;
    }
    dev.flush()?;
    Ok(())
}

/// qemu-nbd (started by `command`) serving the backing file as export `nvme0`, writeback cache
/// like the lanbus rows' controller, listening where `listen` says.
fn qemu_nbd(mut command: Command, dir: &Path, listen: &[String]) -> anyhow::Result<KillOnDrop> {
    let child = end_with_parent(&mut command)
        .args(["--format=raw", "--persistent", "--export-name=nvme0", "--cache=writeback"])
        .arg(format!("--shared={MAX_JOBS}"))
        .args(listen)
        .arg(dir.join("backing.img"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("qemu-nbd (Debian package qemu-utils)")?;
    Ok(KillOnDrop(child))
}

fn qemu(dir: &Path) -> anyhow::Result<(Holder, String)> {
    let socket = dir.join("qemu-nbd.sock");
    let _ = std::fs::remove_file(&socket);
    let child = qemu_nbd(Command::new("qemu-nbd"), dir, &[format!("--socket={}", socket.display())])?;
    wait_for_socket(&socket, "nvme0")?;
    Ok((Holder::Qemu(child), format!("nbd+unix:///nvme0?socket={}", socket.display())))
}

/// qemu-nbd in namespace b of `veth` serving the backing file over TCP on its address; the URI
/// for fio in namespace a.
fn qemu_tcp(dir: &Path, veth: &VethPair) -> anyhow::Result<(Holder, String)> {
    let addr = std::net::SocketAddr::from((veth.b.ipv4, NBD_TCP_PORT));
    let listen = [format!("--bind={}", veth.b.ipv4), format!("--port={NBD_TCP_PORT}")];
    let child = qemu_nbd(veth.b.netns.command("qemu-nbd"), dir, &listen)?;
    // Ready once it accepts a connection from the client's side of the link.
    let t = std::time::Instant::now();
    loop {
        let up = veth
            .a
            .netns
            .run(move || {
                std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(200)).is_ok()
            })
            .unwrap_or(false);
        if up {
            break;
        }
        if t.elapsed() > std::time::Duration::from_secs(10) {
            bail!("qemu-nbd did not listen on {addr} in namespace {}", veth.b.netns.name());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok((Holder::Qemu(child), format!("nbd://{addr}/nvme0")))
}

/// fio's unmeasured ramp-up before each run, seconds (`run_fio`'s `--ramp_time`).
const FIO_RAMP_S: f64 = 1.0;

/// The TCP port of the `peer:nbd-tcp` row's qemu-nbd (NBD's registered port).
const NBD_TCP_PORT: u16 = 10809;

fn wait_for_socket(socket: &Path, export: &str) -> anyhow::Result<()> {
    let t = std::time::Instant::now();
    while lanbus_nbd::Client::connect_unix(socket, export).is_err() {
        if t.elapsed() > std::time::Duration::from_secs(10) {
            bail!("no NBD server came up on {}", socket.display());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(())
}

/// Runs the benchmark.
pub fn run(args: NvmeBenchArgs) -> anyhow::Result<()> {
    let help = Command::new("fio").arg("--enghelp=nbd").output().context("fio is not installed")?;
    if !String::from_utf8_lossy(&help.stdout).contains("uri") {
        bail!("this fio has no nbd engine");
    }
    let dir = ScratchDir::create("nvme")?;
    let report = measure(&args, dir.path())?;
    drop(dir);
    report.finish(args.json.as_deref())?;
    for rw in args.directions() {
        let mut series: Vec<Series> = Vec::new();
        for row in &report.rows {
            if row.metric != "mb_per_s" || row.params.get("rw").and_then(|v| v.as_str()) != Some(rw) {
                continue;
            }
            let bs = row.params.get("block_size").and_then(|v| v.as_f64()).unwrap_or(0.0) / 1024.0;
            let mut name = row.name.clone();
            if let Some(d) = row.params.get("iodepth").and_then(|v| v.as_u64()).filter(|&d| d != 1) {
                name.push_str(&format!(" qd{d}"));
            }
            if let Some(j) = row.params.get("numjobs").and_then(|v| v.as_u64()).filter(|&j| j != 1) {
                name.push_str(&format!(" {j} jobs"));
            }
            if args.mtus().len() > 1 {
                if let Some(m) = row.params.get("mtu").and_then(|v| v.as_u64()) {
                    name.push_str(&format!(" MTU {m}"));
                }
            }
            if row.params.get("cmb").and_then(|v| v.as_str()) == Some("off") {
                name.push_str(" CMB off");
            }
            match series.iter_mut().find(|s| s.name == name) {
                Some(s) => s.points.push((bs, row.value)),
                None => series.push(Series { name, points: vec![(bs, row.value)] }),
            }
        }
        let plot = Plot {
            title: format!("NVMe over lanbus, fio {rw}"),
            x_label: "block size (KiB)".into(),
            y_label: "MB/s".into(),
            x_log: true,
            y_log: true,
            legend_right: true,
            series,
        };
        let path = PathBuf::from(format!("{}-{rw}.png", args.png));
        write_png(&plot, &path)?;
        eprintln!("bench nvme: plot {}", path.display());
    }
    Ok(())
}

/// Most `--numjobs`: qemu-nbd serves this many connections at once.
const MAX_JOBS: u32 = 8;

/// The rows that cross the veth, measured at every `--mtu`.
const VETH_ROWS: [&str; 4] = ["udp", "afpacket", "afxdp", "peer:nbd-tcp"];

/// Which row to measure, and how: the veth's MTU (rows that cross it) and whether the driver uses
/// the drive's memory buffer (lanbus rows).
#[derive(Debug, Clone, Copy)]
struct RowSetting {
    name: &'static str,
    mtu: Option<u32>,
    cmb: Option<&'static str>,
    /// The keyed fabric's setting (rows over a fabric).
    security: Option<&'static str>,
}

/// A port's floor: the port kind and the veth's MTU (none over loopback).
type Floor = (&'static str, Option<u32>);

/// One point of one row: what identifies it in the report.
#[derive(Debug, Clone, PartialEq)]
struct Point {
    name: &'static str,
    rw: &'static str,
    block: u64,
    depth: u32,
    jobs: u32,
    /// The veth's MTU, for rows that cross it.
    mtu: Option<u32>,
    /// Whether the driver used the drive's memory buffer (lanbus rows).
    cmb: Option<&'static str>,
    /// The keyed fabric's setting (rows over a fabric).
    security: Option<&'static str>,
}

/// A point's figures, one per run.
#[derive(Debug, Default)]
struct Samples {
    mbs: Vec<f64>,
    iops: Vec<f64>,
    p99: Vec<f64>,
    client_cpu: Vec<f64>,
    server_cpu: Vec<f64>,
    /// Per stage of [`STAGES`], microseconds per request.
    stages: [Vec<f64>; 6],
    /// Per stage of [`COPY_STAGES`], bytes copied per byte of data.
    copies: [Vec<f64>; 7],
}

fn measure(args: &NvmeBenchArgs, dir: &Path) -> anyhow::Result<Report> {
    anyhow::ensure!(
        !args.iodepth.is_empty() && args.iodepth.iter().all(|d| (1..=256).contains(d)),
        "--iodepth: depths of 1 to 256"
    );
    anyhow::ensure!(
        !args.numjobs.is_empty() && args.numjobs.iter().all(|j| (1..=MAX_JOBS).contains(j)),
        "--numjobs: 1 to {MAX_JOBS} jobs"
    );
    anyhow::ensure!(
        !args.mtu.is_empty() && args.mtu.iter().chain(&args.peer_mtu).all(|m| (576..=65_000).contains(m)),
        "--mtu and --peer-mtu: MTUs of 576 to 65000"
    );
    let size = args.size_mib << 20;
    let want = |name: &str| args.only.is_empty() || args.only.iter().any(|o| o == name);
    anyhow::ensure!(
        args.peer_mtu.is_empty() || want("peer:nbd-tcp"),
        "--peer-mtu sets the MTUs of the peer:nbd-tcp row, which --only leaves out"
    );
    let names: Vec<&str> = if args.block_sizes.is_empty() {
        BLOCK_SIZES.to_vec()
    } else {
        args.block_sizes.iter().map(String::as_str).collect()
    };
    // Every size is checked before anything is set up; twice the largest warms each row up.
    let mut sizes = Vec::with_capacity(names.len());
    for bs in names {
        sizes.push((bs, lanbus_node::parse_size(bs).with_context(|| format!("--block-sizes {bs:?}"))?));
    }
    let largest = sizes.iter().map(|&(_, bytes)| bytes).max().unwrap_or(0);
    let veth = if VETH_ROWS.iter().any(|n| want(n)) {
        match lanbus_port::netns::VethPair::create() {
            Ok(v) => Some(v),
            Err(skip) => {
                eprintln!(
                    "bench nvme: rows afpacket, afxdp and peer:nbd-tcp missing: {skip}; udp runs over loopback"
                );
                None
            }
        }
    } else {
        None
    };
    // Each row's drive and bridges exist only while it is measured: idle bridges would take CPU
    // from the others, and an AF_XDP socket takes the veth's lanbus frames from AF_PACKET.
    let mut rows: Vec<&'static str> = vec!["local", "peer:qemu-nbd", "sim", "udp"];
    if veth.is_some() {
        rows.extend(["peer:nbd-tcp", "afpacket", "afxdp"]);
    }
    rows.retain(|n| want(n));
    let runs = args.runs.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    let mut cmbs: Vec<&'static str> =
        ["on", "off"].into_iter().filter(|c| args.cmb.iter().any(|a| a == c)).collect();
    if cmbs.is_empty() {
        cmbs.push("on");
    }
    let mut securities: Vec<&'static str> =
        crate::SECURITY.into_iter().filter(|c| args.security.iter().any(|a| a == c)).collect();
    if securities.is_empty() {
        securities.push("off");
    }
    let runtime = if args.quick { 1 } else { 2 };
    create_backing(dir, size)?;
    let mut points: Vec<(Point, Samples)> = Vec::new();
    let mut floors: Vec<(Floor, Vec<f64>)> = Vec::new();
    let mut missing: Vec<String> = Vec::new();
    // Runs go in turns: every row (at every MTU) once, then again; a figure is the median of its
    // runs, so a drift of the machine's speed spreads over all rows alike.
    let mtus = args.mtus();
    for run in 1..=runs {
        for (m, &mtu) in mtus.iter().enumerate() {
            if let Some(v) = &veth {
                v.set_mtu(mtu as usize).with_context(|| format!("setting the veth's MTU to {mtu}"))?;
            }
            // Each lanbus row at every `--cmb` (and each row over a fabric at every
            // `--security`), the peers once.
            let settings = rows.iter().flat_map(|&name| {
                let cmb: Vec<Option<&'static str>> = if name.starts_with("peer:") {
                    vec![None]
                } else {
                    cmbs.iter().map(|&c| Some(c)).collect()
                };
                let security: Vec<Option<&'static str>> = if name.starts_with("peer:") || name == "local" {
                    vec![None]
                } else {
                    securities.iter().map(|&s| Some(s)).collect()
                };
                cmb.into_iter().flat_map(move |c| security.clone().into_iter().map(move |s| (name, c, s)))
            });
            // Each run starts one row further on, so that no row always follows the same one
            // (a row's figures carry some of what the row before it left: caches, the
            // scheduler's placement of threads on the cores).
            let mut settings: Vec<_> = settings.collect();
            let turn = (run - 1) % settings.len().max(1);
            settings.rotate_left(turn);
            for (name, cmb, security) in settings {
                let crosses = veth.is_some() && VETH_ROWS.contains(&name);
                // Rows without the veth do not depend on its MTU: once per run.
                if (!crosses && m > 0) || (crosses && !args.runs_at(name, mtu)) {
                    continue;
                }
                let mtu = crosses.then_some(mtu);
                let mut label = mtu.map_or(name.to_string(), |m| format!("{name} (MTU {m})"));
                if cmb == Some("off") {
                    label.push_str(" (CMB off)");
                }
                if let Some(s) = security.filter(|&s| s != "off") {
                    label.push_str(&format!(" ({s})"));
                }
                eprintln!("bench nvme: run {run}/{runs}: {label}");
                let row = RowSetting { name, mtu, cmb, security };
                if let Err(e) =
                    measure_row(args, dir, veth.as_ref(), row, &sizes, largest, runtime, &mut points)
                {
                    eprintln!("bench nvme: row {label} missing: {e:#}");
                    if !missing.contains(&label) {
                        missing.push(label);
                    }
                    continue;
                }
                // The bare port's floor, right after its row and with the row's bridges gone.
                if ["udp", "afpacket", "afxdp"].contains(&name) {
                    match raw_one_way(name, veth.as_ref(), runtime as f64) {
                        Ok(g) => match floors.iter_mut().find(|(k, _)| *k == (name, mtu)) {
                            Some((_, v)) => v.push(g * 1e3 / 8.0),
                            None => floors.push(((name, mtu), vec![g * 1e3 / 8.0])),
                        },
                        Err(e) => eprintln!("bench nvme: raw:{name} floor: {e:#}"),
                    }
                }
            }
        }
    }
    if !missing.is_empty() {
        eprintln!("bench nvme: rows not measured: {}", missing.join(", "));
    }
    let mut report = Report::new("nvme");
    for (p, s) in &points {
        let (Some(m), Some(i)) = (median(&s.mbs), median(&s.iops)) else { continue };
        let mut figures = vec![("mb_per_s", m), ("iops", i)];
        if p.block == 4096 {
            figures.extend(median(&s.p99).map(|v| ("p99_us", v)));
        }
        figures.extend(median(&s.client_cpu).map(|c| ("client_cpu_s_per_gb", c)));
        figures.extend(median(&s.server_cpu).map(|c| ("server_cpu_s_per_gb", c)));
        let stages = STAGES.iter().zip(&s.stages).filter_map(|(stage, v)| median(v).map(|m| (*stage, m)));
        let stages = stages.map(|(stage, m)| ("stage_us", stage, m));
        // Copies: each stage's median, and the median of the runs' totals.
        let totals: Vec<f64> =
            (0..s.copies[0].len()).map(|run| s.copies.iter().map(|v| v[run]).sum()).collect();
        let copies = COPY_STAGES
            .iter()
            .zip(&s.copies)
            .filter_map(|(stage, v)| median(v).map(|m| (*stage, m)))
            .chain(median(&totals).map(|m| ("all", m)))
            .map(|(stage, m)| ("copies_per_byte", stage, m));
        for (metric, value) in figures {
            let mut row = Row::new(p.name, metric, value)
                .with("rw", p.rw)
                .with("block_size", p.block)
                .with("iodepth", p.depth)
                .with("numjobs", p.jobs);
            if !p.name.starts_with("peer:") {
                row = row.with("completion", args.completion.as_str());
            }
            if let Some(cmb) = p.cmb {
                row = row.with("cmb", cmb);
            }
            if let Some(security) = p.security {
                row = row.with("security", security);
            }
            if let Some(mtu) = p.mtu {
                row = row.with("mtu", mtu);
            }
            report.push(row);
        }
        for (metric, stage, value) in stages.chain(copies) {
            let mut row = Row::new(p.name, metric, value)
                .with("stage", stage)
                .with("rw", p.rw)
                .with("block_size", p.block)
                .with("iodepth", p.depth)
                .with("numjobs", p.jobs);
            if let Some(mtu) = p.mtu {
                row = row.with("mtu", mtu);
            }
            if let Some(cmb) = p.cmb {
                row = row.with("cmb", cmb);
            }
            if let Some(security) = p.security {
                row = row.with("security", security);
            }
            report.push(row);
        }
    }
    for ((name, mtu), v) in &floors {
        if let Some(m) = median(v) {
            let mut row = Row::new(format!("raw:{name}"), "mb_per_s_one_way", m);
            if let Some(mtu) = mtu {
                row = row.with("mtu", *mtu);
            }
            report.push(row);
        }
    }
    crate::versus_security_off(&mut report, "mb_per_s", true, None);
    // At one request in flight, 1/IOPS is each request's time.
    crate::versus_security_off(&mut report, "iops", false, Some(|iops| 1e6 / iops));
    for row in crate::crypto_rows(&args.security, runs) {
        report.push(row);
    }
    crate::crypto_floor(&mut report, "mb_per_s");
    ratios_vs_nbd_tcp(&mut report);
    Ok(report)
}

/// Sets up row `name` (at `mtu` if it crosses the veth), warms it up, runs fio once at every
/// point and adds the figures to `points`; the row's drive and bridges go when it returns.
#[allow(clippy::too_many_arguments)]
fn measure_row(
    args: &NvmeBenchArgs,
    dir: &Path,
    veth: Option<&VethPair>,
    row: RowSetting,
    sizes: &[(&str, u64)],
    largest: u64,
    runtime: u64,
    points: &mut Vec<(Point, Samples)>,
) -> anyhow::Result<()> {
    let RowSetting { name, mtu, cmb, security } = row;
    let keyed = |pair| crate::secured(pair, security.unwrap_or("off"));
    let dcfg = args.driver_config(cmb.unwrap_or("on"));
    // fio runs here, except across the veth for the TCP peer.
    let fio_ns = (name == "peer:nbd-tcp").then(|| veth.map(|v| &v.a.netns)).flatten();
    let (holder, uri) = match name {
        "local" => local(dir, dcfg)?,
        "peer:qemu-nbd" => qemu(dir)?,
        "peer:nbd-tcp" => qemu_tcp(dir, veth.context("needs a veth pair (root)")?)?,
        "sim" => over(dir, "sim", keyed(SimFabric::sim_ports(0.0, 1)?), dcfg)?,
        kind => over(dir, kind, keyed(super::port_pair(kind, veth)?), dcfg)?,
    };
    // The serving side's process: qemu-nbd for the peers; this one (bridges, driver, NBD server,
    // controller) for the lanbus rows.
    let server_pid = match &holder {
        Holder::Qemu(child) => child.0.id(),
        _ => std::process::id(),
    };
    warm_up(fio_ns, &uri, args, 2 * largest)?;
    let shapes: Vec<(u32, u32)> =
        args.iodepth.iter().flat_map(|&d| args.numjobs.iter().map(move |&j| (d, j))).collect();
    for rw in args.directions() {
        for (&(depth, jobs), &(bs, block)) in shapes.iter().flat_map(|s| sizes.iter().map(move |z| (s, z))) {
            let before = cpu_seconds(server_pid);
            let stamps = holder.stamps();
            let r = match run_fio(fio_ns, &uri, rw, bs, depth, jobs, args.size_mib, runtime) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("bench nvme: {name} {rw} {bs}: {e:#}");
                    continue;
                }
            };
            let point = Point { name, rw, block, depth, jobs, mtu, cmb, security };
            let i = match points.iter().position(|(p, _)| *p == point) {
                Some(i) => i,
                None => {
                    points.push((point, Samples::default()));
                    points.len() - 1
                }
            };
            let s = &mut points[i].1;
            s.mbs.push(r.mb_per_s);
            s.iops.push(r.iops);
            s.p99.push(r.p99_us);
            let gb = r.bytes / 1e9;
            s.client_cpu.push(r.client_cpu_s / gb);
            // The server's CPU covers fio's ramp-up second too: counted at the measured rate.
            let served_gb = gb * (runtime as f64 + FIO_RAMP_S) / runtime as f64;
            if let (Some(b), Some(a)) = (before, cpu_seconds(server_pid)) {
                s.server_cpu.push((a - b) / served_gb);
            }
            if let Some(per) = stamps.zip(holder.stamps()).and_then(|(b, a)| b.copies_per_byte(&a)) {
                for (v, samples) in per.into_iter().zip(s.copies.iter_mut()) {
                    samples.push(v);
                }
            }
            // The stages are per request of one request at a time.
            if depth == 1 && jobs == 1 && r.iops > 0.0 {
                if let Some(per) =
                    stamps.zip(holder.stamps()).and_then(|(b, a)| b.per_request(&a, 1e6 / r.iops))
                {
                    for (v, samples) in per.into_iter().zip(s.stages.iter_mut()) {
                        samples.push(v);
                    }
                }
            }
            eprintln!(
                "bench nvme: {name:>14} {rw:>9} {bs:>4} qd{depth} x{jobs}: {:8.1} MB/s {:8.0} IOPS",
                r.mb_per_s, r.iops
            );
        }
    }
    drop(holder);
    Ok(())
}

/// Each lanbus row's bandwidth against `peer:nbd-tcp`'s at the same direction, block size, depth
/// and jobs (`ratio_vs_nbd_tcp`, with the peer's `peer_mtu`): the peer at the row's own MTU where
/// it ran there, else the peer at each MTU it ran at (`--peer-mtu`).
fn ratios_vs_nbd_tcp(report: &mut Report) {
    let param = |r: &Row, k: &str| r.params.get(k).cloned();
    let key = |r: &Row| (param(r, "rw"), param(r, "block_size"), param(r, "iodepth"), param(r, "numjobs"));
    let peer: Vec<_> = report
        .rows
        .iter()
        .filter(|r| r.name == "peer:nbd-tcp" && r.metric == "mb_per_s")
        .map(|r| (key(r), param(r, "mtu"), r.value))
        .collect();
    let mut ratios = Vec::new();
    for r in report.rows.iter().filter(|r| !r.name.starts_with("peer:") && r.metric == "mb_per_s") {
        let (k, mtu) = (key(r), param(r, "mtu"));
        let same: Vec<_> = peer.iter().filter(|(pk, _, _)| *pk == k).collect();
        // The peer at the row's own MTU where it ran there, else at each MTU it ran at.
        let at_mtu: Vec<_> = same.iter().filter(|(_, pm, _)| *pm == mtu).copied().collect();
        for (_, peer_mtu, base) in if at_mtu.is_empty() { same } else { at_mtu } {
            let mut row = Row::new(r.name.clone(), "ratio_vs_nbd_tcp", r.value / base);
            for (k, v) in &r.params {
                row = row.with(k, v.clone());
            }
            if let Some(m) = peer_mtu {
                row = row.with("peer_mtu", m.clone());
            }
            ratios.push(row);
        }
    }
    report.rows.extend(ratios);
}

/// The bare port's one-way bandwidth (`raw:KIND` rows, Gbit/s of whole frames): `a` sends frames
/// of the link's MTU to `b` as fast as it takes them for `seconds`, `b` counts what arrives. The
/// same ports as the row's, opened the same way, with no transport, bridge or drive: the floor
/// the row's figures stand on. Returns Gbit/s received.
pub(crate) fn raw_one_way(kind: &str, veth: Option<&VethPair>, seconds: f64) -> anyhow::Result<f64> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (mut a, mut b) = super::port_pair(kind, veth)?;
    let len = lanbus_wire::ethernet::HEADER_LEN + a.mtu().min(b.mtu());
    let mut frame = vec![0u8; len];
    frame[0..6].copy_from_slice(&b.mac().0);
    frame[6..12].copy_from_slice(&a.mac().0);
    frame[12..14].copy_from_slice(&lanbus_wire::ethernet::EtherType::LANBUS_RAW.to_be_bytes());
    let stop = Arc::new(AtomicBool::new(false));
    let sending = stop.clone();
    let sender = std::thread::spawn(move || {
        // Frames go out the way the runtime sends the transport's: from the sender's memory where
        // the port borrows frames (on a veth, one copy fewer than through its ring), else copied
        // into the port's buffers.
        let burst = [frame.as_slice(); 32];
        // Relaxed: only the flag itself is published.
        while !sending.load(Ordering::Relaxed) {
            let sent = if a.borrows_frames() {
                a.tx_borrowed(&burst)
            } else {
                a.tx_burst(burst.len(), &mut |buf| {
                    buf[..frame.len()].copy_from_slice(&frame);
                    Some(frame.len())
                })
            };
            if !matches!(sent, Ok(n) if n > 0) {
                std::thread::yield_now();
            }
        }
    });
    let start = std::time::Instant::now();
    let until = start + std::time::Duration::from_secs_f64(seconds);
    let mut bytes = 0u64;
    while std::time::Instant::now() < until {
        let n = b.rx_burst(64, &mut |f| bytes += f.len() as u64)?;
        if n == 0 {
            std::thread::yield_now();
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let _ = sender.join();
    Ok(bytes as f64 * 8.0 / elapsed / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(mtu: &[u32], peer_mtu: &[u32]) -> NvmeBenchArgs {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            a: NvmeBenchArgs,
        }
        let mut a = Cli::parse_from(["nvme"]).a;
        (a.mtu, a.peer_mtu) = (mtu.to_vec(), peer_mtu.to_vec());
        a
    }

    fn mbs(name: &str, mtu: u32, value: f64) -> Row {
        Row::new(name, "mb_per_s", value)
            .with("rw", "randread")
            .with("block_size", 1_048_576u64)
            .with("iodepth", 1u32)
            .with("numjobs", 1u32)
            .with("mtu", mtu)
    }

    /// (row's MTU, peer's MTU, ratio) of every ratio row.
    fn ratios(rows: Vec<Row>) -> Vec<(u64, u64, f64)> {
        let mut report = Report::new("nvme");
        report.rows = rows;
        ratios_vs_nbd_tcp(&mut report);
        let mtu = |r: &Row, k: &str| r.params[k].as_u64().expect("an MTU");
        report
            .rows
            .iter()
            .filter(|r| r.metric == "ratio_vs_nbd_tcp")
            .map(|r| (mtu(r, "mtu"), mtu(r, "peer_mtu"), r.value))
            .collect()
    }

    #[test]
    fn the_peer_runs_at_its_own_mtus() {
        let a = args(&[9000, 65000], &[1500, 9000]);
        assert_eq!(a.mtus(), [9000, 65000, 1500]);
        assert!(a.runs_at("afpacket", 65000) && !a.runs_at("afpacket", 1500));
        assert!(a.runs_at("peer:nbd-tcp", 1500) && !a.runs_at("peer:nbd-tcp", 65000));
        let same = args(&[1500, 9000], &[]);
        assert_eq!(same.mtus(), [1500, 9000]);
        assert!(same.runs_at("peer:nbd-tcp", 1500) && same.runs_at("afpacket", 9000));
    }

    #[test]
    fn a_row_is_compared_with_the_peer_at_its_mtu_else_at_each_of_the_peers() {
        let rows = vec![
            mbs("peer:nbd-tcp", 9000, 800.0),
            mbs("afpacket", 9000, 400.0),
            mbs("afpacket", 65000, 1000.0),
        ];
        assert_eq!(ratios(rows), [(9000, 9000, 0.5), (65000, 9000, 1.25)]);
        let rows = vec![
            mbs("peer:nbd-tcp", 1500, 500.0),
            mbs("peer:nbd-tcp", 9000, 800.0),
            mbs("afpacket", 9000, 400.0),
            mbs("afpacket", 65000, 1000.0),
        ];
        assert_eq!(ratios(rows), [(9000, 9000, 0.5), (65000, 1500, 2.0), (65000, 9000, 1.25)]);
        // Another size or direction is never compared.
        let other = mbs("peer:nbd-tcp", 9000, 800.0).with("rw", "randwrite");
        assert!(ratios(vec![other, mbs("afpacket", 9000, 400.0)]).is_empty());
    }
}
