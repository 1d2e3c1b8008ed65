//! `lanbus demo`: the main job. No arguments, no root, no NIC.
//!
//! A device bridge hosts an NVMe controller model with a RAM namespace; a host bridge enumerates
//! it over the in-process simulated wire (a little loss, so the transport retransmits), the
//! user-space NVMe driver starts on it, and the namespace is exported over NBD on a Unix socket
//! in a temporary directory. Then, through that socket: a mixed workload of random data at
//! several sizes with a built-in NBD client (every byte of the drive read back and compared with
//! what was written), fio with `--verify=crc32c` if fio is installed, a bandwidth table, and the
//! counters of the transport, the bridges and the controller. Exits 0 only if all data verified.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use lanbus_nbd::Client;
use rand::{Rng, SeedableRng};

use lanbus_node::config::ExportSpec;
use lanbus_node::device::{Device, DeviceOptions};
use lanbus_node::drive::NvmeBacking;
use lanbus_node::fabric::SimFabric;
use lanbus_node::host::{Host, HostOptions};
use lanbus_node::security::Keyed;

/// Arguments of `lanbus demo` (none needed).
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Probability that the simulated wire loses a frame, each way.
    #[arg(long, default_value_t = 0.001)]
    loss: f64,
    /// Size of the RAM drive in MiB.
    #[arg(long, default_value_t = 64)]
    size_mib: u64,
    /// Seed of the wire's losses and of the workload's data.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Skip fio even if it is installed.
    #[arg(long)]
    no_fio: bool,
    /// Where the demo's threads run: `one` (the default) keeps all of them, both machines' and
    /// fio's, on one CPU, which makes the table repeatable; `all` lets them move between CPUs,
    /// where on a small shared machine the scheduler's placement of the spinning threads decides
    /// a run (the 4K row then swings about 2x from run to run).
    #[arg(long, value_enum, default_value = "one")]
    cpus: Cpus,
}

/// Where the demo's threads may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Cpus {
    /// One CPU for every thread.
    One,
    /// Any CPU the process may use.
    All,
}

struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn mb_per_s(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / 1e6 / t.as_secs_f64().max(1e-9)
}

/// Runs the demo.
pub fn run(a: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!((0.0..0.2).contains(&a.loss), "--loss must be in 0..0.2");
    anyhow::ensure!((8..=4096).contains(&a.size_mib), "--size-mib must be 8..=4096");
    // Before any thread starts, so every thread (and fio) inherits it.
    let pinned = match a.cpus {
        Cpus::One => lanbus_ring::study::allowed_cpus()
            .last()
            .copied()
            .filter(|&cpu| lanbus_ring::study::pin_current_thread(cpu)),
        Cpus::All => None,
    };
    let started = Instant::now();
    let size = a.size_mib << 20;
    println!("lanbus demo: a remote NVMe drive over the lanbus fabric, in one process\n");
    println!(
        "  I/O box: device bridge hosting an NVMe controller model, {} MiB RAM namespace, 512-byte blocks",
        a.size_mib
    );
    println!(
        "  wire:    in-process simulated Ethernet (10 Gbit/s, {:.1}% frame loss each way, seed {})",
        a.loss * 100.0,
        a.seed
    );
    println!("  host:    host bridge, user-space NVMe driver, NBD server on a Unix socket");
    // A key of this run only: both ends prove it in a handshake and seal every frame under it.
    let ring = lanbus_secure::KeyRing::new(lanbus_secure::FabricKey::generate(), []);
    let (box_keys, host_keys) = (Keyed::in_memory(ring.clone(), false), Keyed::in_memory(ring, false));
    println!("  key:     {} (a random key of this run)", box_keys.describe());
    match pinned {
        Some(cpu) => println!("  threads: all on CPU {cpu} (--cpus all lets them move)\n"),
        None => println!("  threads: on any CPU\n"),
    }
    let dir = TempDir(std::env::temp_dir().join(format!("lanbus-demo-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0)?;
    let socket = dir.0.join("nvme0.sock");
    // The very I/O box and host that `lanbus device` and `lanbus host` run, on the two ends of
    // the simulated wire.
    let (host_port, device_port) = SimFabric::sim_ports(a.loss, a.seed)?;
    let (host_port, device_port) = (host_keys.wrap(host_port), box_keys.wrap(device_port));
    let mut box_options = DeviceOptions::new(1, "demo-iobox");
    box_options.nvme = Some(NvmeBacking::Ram(size));
    box_options.security = box_keys.view();
    let device = Device::start(device_port, box_options)?;
    let mut host_options = HostOptions::new(1, "demo-host", vec![ExportSpec::Unix(socket.clone())]);
    host_options.security = host_keys.view();
    let host = Host::start(host_port, host_options, Box::new(|line| tracing::info!("host: {line}")))?;
    let driver = host
        .wait_exported(Duration::from_secs(10))
        .context("the host did not enumerate and export the drive within 10 s")?;
    println!("enumerated through configuration TLPs ({:.0} ms):", started.elapsed().as_secs_f64() * 1e3);
    for f in host.bridge().devices() {
        print!("{}", lanbus_node::lspci::describe(&f));
    }
    let id = driver.identity().clone();
    println!(
        "NVMe driver: {:?} serial {:?}, namespace {} x {} bytes, {} I/O queue pairs, MSI-X interrupts\n",
        id.model,
        id.serial,
        id.blocks,
        id.lba_size,
        driver.io_queue_count()
    );
    drop(driver);
    let uri = format!("nbd+unix:///nvme0?socket={}", socket.display());
    println!("exported over NBD: {uri}\n");

    let table = workload(&socket, size, a.seed)?;
    let fio = if a.no_fio { None } else { fio_verify(&uri, &dir.0)? };

    println!(
        "\nbandwidth through NBD -> NVMe driver -> fabric -> controller (one request in flight; \
         each figure the median of {SLICES} slices of its phase):"
    );
    println!("  {:>8}  {:>10}  {:>10}  {:>9}", "block", "write MB/s", "read MB/s", "read IOPS");
    for (bs, w, r, iops) in &table {
        println!("  {:>8}  {:>10.1}  {:>10.1}  {:>9.0}", size_label(*bs), w, r, iops);
    }
    if let Some(rows) = &fio {
        for (what, mbs) in rows {
            println!("  fio {what}: {mbs:.1} MB/s, verified");
        }
    }

    let stats = host.nbd_stats().context("the drive is no longer exported")?;
    let h = host.bridge().runtime_stats();
    let d = device.bridge().runtime_stats();
    let hb = host.bridge().stats();
    let counter = |name: &str| device.samples().iter().find(|s| s.name == name).map_or(0, |s| s.value as u64);
    println!("\ncounters:");
    println!(
        "  NBD:        {} connections, {} reads, {} writes, {} flushes, {} device errors",
        stats.connections_accepted,
        stats.requests_read,
        stats.requests_write,
        stats.requests_flush,
        stats.device_errors
    );
    println!(
        "  controller: {} I/O commands, {} MB read, {} MB written, {} errors",
        counter("nvme_io_commands_total"),
        counter("nvme_bytes_read_total") / 1_000_000,
        counter("nvme_bytes_written_total") / 1_000_000,
        counter("nvme_error_completions_total")
    );
    println!(
        "  host bridge: {} TLPs in, {} DMA reads served, {} DMA writes applied, {} MSI-X, {} completion timeouts",
        hb.tlps_received, hb.dma_reads_served, hb.dma_writes_applied, hb.interrupts, hb.timeouts
    );
    for (who, rt) in [("host", h), ("device", d)] {
        let t = rt.transport;
        println!(
            "  transport ({who}): {} frames sent, {} retransmitted ({} fast retransmits, {} tail-loss \
             probes, {} timeouts), {} held past a hole, {} dropped out of order",
            t.frames_sent,
            t.retransmitted_frames,
            t.fast_retransmits,
            t.tail_loss_probes,
            t.timeouts,
            t.frames_held,
            t.drop_out_of_order
        );
    }
    for (who, keys) in [("host", &host_keys), ("device", &box_keys)] {
        if let Some(r) = keys.view().map(|v| v.report()) {
            let c = r.counters;
            println!(
                "  fabric key ({who}): {} frames sealed, {} opened, {} sessions, {} refused",
                c.sealed,
                c.opened,
                c.sessions_established,
                c.rejected.total()
            );
        }
    }
    host.shutdown();
    device.shutdown()?;
    println!(
        "\nall data verified: {} MiB through the built-in client{}. {:.1} s.",
        a.size_mib,
        if fio.is_some() { " and fio (crc32c)" } else { "" },
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Slices each timed phase of the workload is cut into (a row shows the median slice).
const SLICES: usize = 8;

/// The median of `times` (the upper one of an even count).
fn median_duration(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn size_label(bs: usize) -> String {
    if bs >= 1 << 20 {
        format!("{}M", bs >> 20)
    } else {
        format!("{}K", bs >> 10)
    }
}

/// Random writes of random data at several sizes, trims, zeroes and a flush; the whole drive
/// read back and compared with a shadow copy. Returns (block size, write MB/s, read MB/s, read
/// IOPS) per block size.
fn workload(socket: &Path, size: u64, seed: u64) -> anyhow::Result<Vec<(usize, f64, f64, f64)>> {
    let mut c = Client::connect_unix(socket, "nvme0").context("connecting the built-in NBD client")?;
    anyhow::ensure!(c.size_bytes() == size, "export size {} != {size}", c.size_bytes());
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut shadow = vec![0u8; size as usize];
    let mut table = Vec::new();
    let sizes = [4096usize, 16 << 10, 64 << 10, 256 << 10, 1 << 20];
    println!("mixed workload (built-in NBD client): random data at {} block sizes", sizes.len());
    // Warm-up, not timed: the first requests of a run pay for the drive's pages being touched
    // for the first time and for idle cores waking; a row should show the steady path.
    let mut data = vec![0u8; 64 << 10];
    for i in 0..256u64 {
        let off = (i * 7919 % (size / 65_536)) * 65_536;
        rng.fill(&mut data[..]);
        c.write(off, &data, false)?;
        shadow[off as usize..off as usize + data.len()].copy_from_slice(&data);
        c.read(off, &mut data)?;
    }
    for &bs in &sizes {
        let ops = ((8 << 20) / bs).clamp(16, 512);
        let offsets: Vec<u64> =
            (0..ops).map(|_| rng.random_range(0..(size - bs as u64) / 512) * 512).collect();
        let mut data = vec![0u8; bs];
        // Each phase is timed in slices, and a row shows the median slice's rate: on a shared
        // machine one descheduled moment would otherwise decide a whole row.
        let slice = ops.div_ceil(SLICES);
        let mut write_times = Vec::new();
        for part in offsets.chunks(slice) {
            let t = Instant::now();
            for &off in part {
                rng.fill(&mut data[..]);
                c.write(off, &data, false)?;
                shadow[off as usize..off as usize + bs].copy_from_slice(&data);
            }
            write_times.push(t.elapsed() / part.len() as u32);
        }
        let mut read_times = Vec::new();
        for part in offsets.chunks(slice) {
            let t = Instant::now();
            for &off in part {
                c.read(off, &mut data)?;
                if data[..] != shadow[off as usize..off as usize + bs] {
                    bail!("DATA MISMATCH: {bs}-byte read at offset {off} differs from what was written");
                }
            }
            read_times.push(t.elapsed() / part.len() as u32);
        }
        let per_op_write = median_duration(&mut write_times);
        let per_op_read = median_duration(&mut read_times);
        table.push((
            bs,
            mb_per_s(bs as u64, per_op_write),
            mb_per_s(bs as u64, per_op_read),
            1.0 / per_op_read.as_secs_f64(),
        ));
        println!("  {:>5}: {ops} random writes, {ops} reads, verified", size_label(bs));
    }
    // Deallocate and write zeroes: both read back as zeroes.
    for _ in 0..8 {
        let off = rng.random_range(0..(size - (1 << 20)) / 4096) * 4096;
        let len = rng.random_range(1..=256u32) * 4096;
        if rng.random_bool(0.5) {
            c.write_zeroes(off, len, false)?;
        } else {
            c.trim(off, len)?;
        }
        shadow[off as usize..off as usize + len as usize].fill(0);
    }
    c.flush()?;
    let t = Instant::now();
    let mut buf = vec![0u8; 1 << 20];
    for off in (0..size).step_by(buf.len()) {
        c.read(off, &mut buf)?;
        if buf[..] != shadow[off as usize..off as usize + buf.len()] {
            bail!("DATA MISMATCH in the MiB at offset {off} after trims, zeroes and flush");
        }
    }
    println!(
        "  trims and write-zeroes, flush, then the whole drive read back and compared: identical ({:.1} MB/s)",
        mb_per_s(size, t.elapsed())
    );
    c.disconnect()?;
    Ok(table)
}

/// fio with the nbd engine and crc32c verification, if fio with that engine is installed.
fn fio_verify(uri: &str, dir: &Path) -> anyhow::Result<Option<Vec<(String, f64)>>> {
    let has_nbd = Command::new("fio")
        .arg("--enghelp=nbd")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("uri"))
        .unwrap_or(false);
    if !has_nbd {
        println!("fio with the nbd engine is not installed (Debian package fio): skipped");
        return Ok(None);
    }
    let mut rows = Vec::new();
    println!("fio (--ioengine=nbd --verify=crc32c):");
    for bs in ["4k", "128k", "1m"] {
        let out = Command::new("fio")
            .args(["--name=demo", "--ioengine=nbd", "--rw=randwrite", "--verify=crc32c", "--do_verify=1"])
            .args(["--verify_fatal=1", "--size=8M", "--iodepth=1", "--output-format=json"])
            .arg(format!("--bs={bs}"))
            .arg(format!("--uri={uri}"))
            .current_dir(dir)
            .output()
            .context("running fio")?;
        if !out.status.success() {
            bail!("fio {bs} random write + verify FAILED: {}", String::from_utf8_lossy(&out.stderr));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let v: serde_json::Value = text
            .find('{')
            .and_then(|i| serde_json::from_str(&text[i..]).ok())
            .context("fio printed no JSON")?;
        let job = &v["jobs"][0];
        if job["error"].as_i64() != Some(0) {
            bail!("fio {bs} reported error {}", job["error"]);
        }
        let w = job["write"]["bw_bytes"].as_f64().unwrap_or(0.0) / 1e6;
        let r = job["read"]["bw_bytes"].as_f64().unwrap_or(0.0) / 1e6;
        println!("  {bs}: random write 8 MiB {w:.1} MB/s, verify read {r:.1} MB/s: crc32c OK");
        rows.push((format!("{bs} randwrite"), w));
        rows.push((format!("{bs} verify read"), r));
    }
    Ok(Some(rows))
}
