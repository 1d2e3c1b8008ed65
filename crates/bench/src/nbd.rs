//! `lanbus bench nbd`: fio (`--ioengine=nbd`) against lanbus's NBD server and against qemu-nbd
//! serving the same backing file, in the same run.
//!
//! Rows: `lanbus-nbd:file` (the in-process server over a [`FileDevice`]), `lanbus-nbd:ram` (over a
//! [`MemDevice`]) and `peer:qemu-nbd` (qemu-nbd on the same file, writeback cache like ours);
//! metrics `mb_per_s` and `iops` with `block_size`, `rw` and `iodepth`, each the median of
//! `--runs` fio runs. The file lives in /dev/shm when it exists, so both servers measure protocol
//! and threading cost rather than the disk.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use lanbus_block::{BlockDevice, FileDevice, MemDevice};
use lanbus_nbd::{Client, Export, Server};

use super::interrupt::{KillOnDrop, ScratchDir};
use super::report::{median, Report, Row};
use lanbus_node::process::end_with_parent;

/// `lanbus bench nbd` options.
#[derive(Debug, Args)]
pub struct NbdBenchArgs {
    /// Write the common JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// fio runs per configuration (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Seconds per fio run.
    #[arg(long, default_value_t = 2)]
    runtime: u64,
    /// Export size in MiB.
    #[arg(long, default_value_t = 256)]
    size_mib: u64,
    /// Block sizes (comma-separated, fio syntax).
    #[arg(long, default_value = "4k,64k,1m", value_delimiter = ',')]
    block_sizes: Vec<String>,
    /// fio I/O depth (the paper's Fig. 6 uses 1).
    #[arg(long, default_value_t = 1)]
    iodepth: u32,
    /// Skip the qemu-nbd peer.
    #[arg(long)]
    no_peer: bool,
}

/// One fio measurement (all its jobs together).
#[derive(Debug, Clone, Copy)]
pub struct FioResult {
    /// Megabytes (10^6) per second.
    pub mb_per_s: f64,
    /// Operations per second.
    pub iops: f64,
    /// 99th percentile of the completion latency, microseconds (of the slowest job, when
    /// there are several).
    pub p99_us: f64,
    /// Bytes moved in the measured time.
    pub bytes: f64,
    /// CPU seconds fio (the client) used in the measured time.
    pub client_cpu_s: f64,
}

/// Runs time-based fio with the nbd engine against `uri`, `numjobs` jobs (each its own
/// connection) of `iodepth` I/Os in flight, and reads its JSON output: inside network namespace
/// `ns` (fio as a client across a link), or here.
#[allow(clippy::too_many_arguments)]
pub fn run_fio(
    ns: Option<&lanbus_port::netns::Netns>,
    uri: &str,
    rw: &str,
    bs: &str,
    iodepth: u32,
    numjobs: u32,
    size_mib: u64,
    runtime: u64,
) -> anyhow::Result<FioResult> {
    let mut command = match ns {
        Some(ns) => ns.command("fio"),
        None => Command::new("fio"),
    };
    let out = end_with_parent(&mut command)
        .args(["--name=bench", "--ioengine=nbd", "--time_based", "--output-format=json"])
        .arg(format!("--numjobs={numjobs}"))
        .arg(format!("--uri={uri}"))
        .arg(format!("--rw={rw}"))
        .arg(format!("--bs={bs}"))
        .arg(format!("--iodepth={iodepth}"))
        .arg(format!("--size={size_mib}M"))
        .arg(format!("--runtime={runtime}"))
        .arg("--ramp_time=1")
        .output()
        .context("running fio (Debian package fio)")?;
    if !out.status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let start = text.find('{').context("fio printed no JSON")?;
    let v: serde_json::Value = serde_json::from_str(&text[start..]).context("parsing fio JSON")?;
    fio_result(&v, rw, numjobs)
}

/// The figures of fio's JSON output `v` for direction `rw`, summed over its `numjobs` jobs.
fn fio_result(v: &serde_json::Value, rw: &str, numjobs: u32) -> anyhow::Result<FioResult> {
    let dir = if rw.contains("read") { "read" } else { "write" };
    let jobs = v["jobs"].as_array().context("fio JSON without jobs")?;
    if jobs.len() != numjobs as usize {
        bail!("fio reported {} jobs, not {numjobs}", jobs.len());
    }
    let mut r = FioResult { mb_per_s: 0.0, iops: 0.0, p99_us: f64::NAN, bytes: 0.0, client_cpu_s: 0.0 };
    for whole in jobs {
        let job = &whole[dir];
        r.mb_per_s += job["bw_bytes"].as_f64().context("fio JSON without bw_bytes")? / 1e6;
        r.iops += job["iops"].as_f64().context("fio JSON without iops")?;
        let p99 = job["clat_ns"]["percentile"]["99.000000"].as_f64().map_or(f64::NAN, |ns| ns / 1e3);
        r.p99_us = r.p99_us.max(p99);
        r.bytes += job["io_bytes"].as_f64().unwrap_or(f64::NAN);
        let cpu_percent =
            whole["usr_cpu"].as_f64().unwrap_or(f64::NAN) + whole["sys_cpu"].as_f64().unwrap_or(f64::NAN);
        let run_s = whole["job_runtime"].as_f64().unwrap_or(f64::NAN) / 1e3;
        r.client_cpu_s += cpu_percent / 100.0 * run_s;
    }
    Ok(r)
}

fn wait_for_socket(socket: &Path) -> anyhow::Result<()> {
    let t = Instant::now();
    while Client::connect_unix(socket, "export").is_err() {
        if t.elapsed() > Duration::from_secs(10) {
            bail!("no NBD server came up on {}", socket.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Runs the benchmark.
pub fn run(args: NbdBenchArgs) -> anyhow::Result<()> {
    let help = Command::new("fio").arg("--enghelp=nbd").output().context("fio is not installed")?;
    if !String::from_utf8_lossy(&help.stdout).contains("uri") {
        bail!("this fio has no nbd engine");
    }
    let dir = ScratchDir::create("nbd")?;
    let report = measure(&args, dir.path())?;
    drop(dir);
    report.finish(args.json.as_deref())?;
    Ok(())
}

fn measure(args: &NbdBenchArgs, dir: &Path) -> anyhow::Result<Report> {
    let size = args.size_mib << 20;
    let image = dir.join("backing.img");
    {
        // Real blocks, not a sparse file: both servers read allocated data.
        let dev = FileDevice::create(&image, size)?;
        let chunk: Vec<u8> = (0..1 << 20).map(|i| (i * 31 + 7) as u8).collect();
        for off in (0..size).step_by(chunk.len()) {
            dev.write_at(off, &chunk, false)?;
        }
        dev.flush()?;
    }
    let mut targets: Vec<(String, String, Option<Server>, Option<KillOnDrop>)> = Vec::new();
    for kind in ["file", "ram"] {
        let socket = dir.join(format!("lanbus-{kind}.sock"));
        let device: Arc<dyn BlockDevice> = if kind == "file" {
            Arc::new(FileDevice::open(&image, false)?)
        } else {
            Arc::new(MemDevice::new(size))
        };
        let server = Server::builder().export(Export::new("export", device)).build()?;
        server.serve(std::os::unix::net::UnixListener::bind(&socket)?)?;
        let uri = format!("nbd+unix:///export?socket={}", socket.display());
        targets.push((format!("lanbus-nbd:{kind}"), uri, Some(server), None));
    }
    if !args.no_peer {
        let socket = dir.join("qemu-nbd.sock");
        match end_with_parent(&mut Command::new("qemu-nbd"))
            .args(["--format=raw", "--persistent", "--shared=4", "--export-name=export", "--cache=writeback"])
            .arg(format!("--socket={}", socket.display()))
            .arg(&image)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        {
            Ok(child) => {
                let child = KillOnDrop(child);
                wait_for_socket(&socket)?;
                let uri = format!("nbd+unix:///export?socket={}", socket.display());
                targets.push(("peer:qemu-nbd".into(), uri, None, Some(child)));
            }
            Err(e) => eprintln!("bench nbd: qemu-nbd not run ({e}); install qemu-utils for the peer row"),
        }
    }
    let mut report = Report::new("nbd");
    for rw in ["randread", "randwrite"] {
        for bs in &args.block_sizes {
            for (name, uri, _, _) in &targets {
                let mut mbs = Vec::new();
                let mut iops = Vec::new();
                for _ in 0..args.runs.max(1) {
                    let r = run_fio(None, uri, rw, bs, args.iodepth, 1, args.size_mib, args.runtime)?;
                    mbs.push(r.mb_per_s);
                    iops.push(r.iops);
                }
                for (metric, values) in [("mb_per_s", &mbs), ("iops", &iops)] {
                    let value = median(values).context("no runs")?;
                    report.push(
                        Row::new(name.clone(), metric, value)
                            .with("rw", rw)
                            .with("block_size", lanbus_node::parse_size(bs)?)
                            .with("iodepth", args.iodepth),
                    );
                }
                eprintln!("bench nbd: {name} {rw} bs={bs}: {:.1} MB/s", median(&mbs).unwrap_or(0.0));
            }
        }
    }
    for (_, _, server, _) in targets {
        if let Some(s) = server {
            s.shutdown()?;
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fio_figures_are_summed_over_the_jobs() {
        let job = |bw: f64, iops: f64, p99_ns: f64, cpu: f64| {
            serde_json::json!({
                "read": {
                    "bw_bytes": bw, "iops": iops, "io_bytes": bw * 2.0,
                    "clat_ns": {"percentile": {"99.000000": p99_ns}}
                },
                "usr_cpu": cpu, "sys_cpu": cpu, "job_runtime": 2000.0
            })
        };
        let v = serde_json::json!({"jobs": [job(100e6, 10.0, 50e3, 10.0), job(300e6, 30.0, 80e3, 15.0)]});
        let r = fio_result(&v, "randread", 2).unwrap();
        assert_eq!((r.mb_per_s, r.iops, r.bytes), (400.0, 40.0, 800e6));
        assert_eq!(r.p99_us, 80.0, "the slowest job's p99");
        assert!((r.client_cpu_s - (0.2 * 2.0 + 0.3 * 2.0)).abs() < 1e-9);
        assert!(fio_result(&v, "randread", 1).is_err(), "a job count other than asked for");
        assert!(fio_result(&serde_json::json!({}), "randread", 1).is_err());
    }
}
