//! `lanbus bench ring`: our SPSC ring against DPDK's rte_ring and the rtrb crate, across two cores.
//!
//! Method: the same as DPDK 22.11's `ring_perf_autotest` (`app/test/test_ring_perf.c`), "Testing
//! using two physical cores", legacy 8-byte-element SP/SC bulk API. DPDK creates a 4096-slot ring;
//! `run_on_core_pair` runs `enqueue_dequeue_bulk_helper` on two lcores, the producer on one doing
//! 2^15 bulk enqueues of `burst` elements, the consumer on the other doing 2^15 bulk dequeues.
//! Both threads first meet at a barrier (atomic add, then spin with `rte_pause` until the count is
//! 2), then each reads the TSC, loops retrying every failed (full/empty) attempt after one
//! `rte_pause` (never yielding, so failed attempts are inside the timed span), reads the TSC
//! again and computes cycles / (2^15 * burst); the printed figure is the sum of the two threads'.
//! We do the same: a 4096-slot ring of u64, warmed by one untimed pass (DPDK's ring was just
//! used by its one-lcore tests), two threads pinned to two CPUs, the same barrier, 2^15 bulk
//! operations per thread, retry after `spin_loop` (PAUSE), `Instant` around the same span, and
//! the sum of producer and consumer ns/element. DPDK's cycles are turned into ns with the TSC
//! frequency measured here. A 2^15-operation window lasts a few milliseconds, so on a machine
//! shared with other jobs a window often loses a thread to the scheduler: the bench runs every
//! ring `--runs` times, interleaved (run 1 of each ring and of dpdk-test, then run 2...), and
//! reports the median (`ns_per_elem`) and the least disturbed run (`ns_per_elem_min`).
//!
//! rte_ring is measured by running `dpdk-test` (Debian package `dpdk-dev`) with
//! `ring_perf_autotest`; when it is missing the bench says how to install it and reports the other
//! rows. Rows `lanbus`, `peer:rte_ring`, `peer:rtrb`, metrics `ns_per_elem` and `ns_per_elem_min`,
//! params `burst` and `cores`; rows `lanbus` / `ratio_to_rte_ring` (`_min`) (ours over rte_ring;
//! below 1 is better). `cores=1` is DPDK's one-lcore "bulk enq/deq" test (2^23 times enqueue a
//! burst and dequeue it on one thread), which load on the machine distorts far less.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use lanbus_ring::study;

use super::report::{median, Report, Row};

/// Arguments of `lanbus bench ring`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Runs per configuration (the median and the minimum are reported).
    #[arg(long, default_value_t = 7)]
    pub runs: usize,
    /// Bulk operations per thread and run in the two-core test (DPDK 22.11 uses 2^15).
    #[arg(long, default_value_t = DPDK_TWO_CORE_ITERATIONS)]
    pub iterations: u64,
    /// Enqueue+dequeue pairs per run in the one-core test (DPDK uses 2^23).
    #[arg(long, default_value_t = DPDK_ONE_CORE_ITERATIONS)]
    pub one_core_iterations: u64,
    /// Skip dpdk-test even if installed.
    #[arg(long)]
    pub no_dpdk: bool,
    /// Write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

const RING_SIZE: usize = 4096;
const BURSTS: [usize; 2] = [8, 32];
const _: () = assert!(BURSTS[0] <= 32 && BURSTS[1] <= 32, "pair's stack buffers hold 32");

/// DPDK 22.11's two-core SP/SC bulk test (`enqueue_dequeue_bulk_helper`, `iter_shift = 15`):
/// bulk operations per thread and burst size.
pub const DPDK_TWO_CORE_ITERATIONS: u64 = 1 << 15;
/// DPDK's one-lcore bulk test (`test_burst_bulk_enqueue_dequeue`, `iter_shift = 23`).
pub const DPDK_ONE_CORE_ITERATIONS: u64 = 1 << 23;

/// Cycles every slot of a fresh ring through once, untimed, so the timed window neither takes the
/// ring memory's first-touch page faults nor starts with cold slots (DPDK's two-core test reuses
/// the ring its one-lcore tests just exercised).
fn warm<P, C>(
    p: &mut P,
    c: &mut C,
    enqueue: impl Fn(&mut P, &[u64]) -> bool,
    dequeue: impl Fn(&mut C, &mut [u64]) -> bool,
) {
    let items = [0u64; 32];
    let mut out = [0u64; 32];
    for _ in 0..(2 * RING_SIZE / items.len()) {
        assert!(enqueue(p, &items) && dequeue(c, &mut out), "an empty ring takes and returns a burst");
    }
}

/// DPDK's barrier: each thread adds itself to a counter, then spins (with a pause hint) until
/// both have, and only then reads its start time.
fn barrier(ready: &AtomicUsize, cpu: Option<usize>) {
    if let Some(c) = cpu {
        study::pin_current_thread(c);
    }
    // AcqRel: both threads start timing only once both are pinned and spinning.
    ready.fetch_add(1, Ordering::AcqRel);
    while ready.load(Ordering::Acquire) < 2 {
        std::hint::spin_loop();
    }
}

/// Runs producer and consumer on two pinned threads exactly as DPDK's two-core SP/SC bulk test:
/// each thread times `iterations` bulk operations of `burst` elements, retrying a failed (full or
/// empty) attempt after a pause hint without yielding, so failed attempts count in its time; the
/// result is producer ns/element + consumer ns/element (DPDK prints the sum of its two threads'
/// cycles/element). `enqueue`/`dequeue` are monomorphised into the loops (no indirect call).
fn pair<P, C, E, D>(
    (mut p, mut c): (P, C),
    enqueue: E,
    dequeue: D,
    burst: usize,
    iterations: u64,
    cpus: Option<(usize, usize)>,
) -> f64
where
    P: Send + 'static,
    C: Send + 'static,
    E: Fn(&mut P, &[u64]) -> bool + Copy + Send + 'static,
    D: Fn(&mut C, &mut [u64]) -> bool + Copy,
{
    warm(&mut p, &mut c, enqueue, dequeue);
    let ready = Arc::new(AtomicUsize::new(0));
    let r2 = ready.clone();
    let producer = std::thread::spawn(move || {
        // Both sides' buffers on their own threads' stacks, as DPDK's `burst` arrays are.
        let mut all = [0u64; 32];
        all.iter_mut().enumerate().for_each(|(k, v)| *v = k as u64);
        let items = &all[..burst];
        barrier(&r2, cpus.map(|c| c.0));
        let t0 = Instant::now();
        for _ in 0..iterations {
            while !enqueue(&mut p, items) {
                std::hint::spin_loop();
            }
        }
        t0.elapsed().as_nanos() as f64 / (iterations as f64 * burst as f64)
    });
    let mut out_all = [0u64; 32];
    let out = &mut out_all[..burst];
    let mut check = 0u64;
    barrier(&ready, cpus.map(|c| c.1));
    let t0 = Instant::now();
    for _ in 0..iterations {
        while !dequeue(&mut c, out) {
            std::hint::spin_loop();
        }
        check = check.wrapping_add(out[burst - 1]);
    }
    let consumer_ns = t0.elapsed().as_nanos() as f64 / (iterations as f64 * burst as f64);
    let producer_ns = producer.join().expect("producer thread");
    assert_eq!(check, iterations * (burst as u64 - 1), "ring delivered wrong elements");
    producer_ns + consumer_ns
}

/// One thread: `iterations` times enqueue a burst then dequeue it (DPDK's "Testing bulk
/// enq/deq" on one lcore); ns per element (its enqueue plus its dequeue). Free of scheduling
/// noise between two cores, so it compares the rings' own instruction cost on a busy machine.
fn one_core<P, C>(
    (mut p, mut c): (P, C),
    enqueue: impl Fn(&mut P, &[u64]) -> bool + Copy,
    dequeue: impl Fn(&mut C, &mut [u64]) -> bool + Copy,
    burst: usize,
    iterations: u64,
) -> f64 {
    warm(&mut p, &mut c, enqueue, dequeue);
    let items: Vec<u64> = (0..burst as u64).collect();
    let mut out = vec![0u64; burst];
    let mut check = 0u64;
    let t0 = Instant::now();
    for _ in 0..iterations {
        assert!(enqueue(&mut p, std::hint::black_box(&items)), "an empty ring takes a burst");
        assert!(dequeue(&mut c, &mut out), "the burst comes back");
        check = check.wrapping_add(std::hint::black_box(&out)[burst - 1]);
    }
    let ns = t0.elapsed().as_nanos() as f64 / (iterations as f64 * burst as f64);
    assert_eq!(check, iterations * (burst as u64 - 1), "ring delivered wrong elements");
    ns
}

fn lanbus_one_core(burst: usize, iterations: u64) -> anyhow::Result<f64> {
    Ok(one_core(
        lanbus_ring::channel::<u64>(RING_SIZE as u32)?,
        |p, items| p.enqueue_bulk(items).expect("in-process ring cannot be corrupted"),
        |c, out| c.dequeue_bulk(out).expect("in-process ring cannot be corrupted"),
        burst,
        iterations,
    ))
}

fn rtrb_one_core(burst: usize, iterations: u64) -> f64 {
    one_core(
        rtrb::RingBuffer::<u64>::new(RING_SIZE - 1),
        |p, items| p.push_entire_slice(items).is_ok(),
        |c, out| c.pop_entire_slice(out).is_ok(),
        burst,
        iterations,
    )
}

fn lanbus_once(burst: usize, iterations: u64, cpus: Option<(usize, usize)>) -> anyhow::Result<f64> {
    let ends = lanbus_ring::channel::<u64>(RING_SIZE as u32)?;
    Ok(pair(
        ends,
        |p, items| p.enqueue_bulk(items).expect("in-process ring cannot be corrupted"),
        |c, out| c.dequeue_bulk(out).expect("in-process ring cannot be corrupted"),
        burst,
        iterations,
        cpus,
    ))
}

fn rtrb_once(burst: usize, iterations: u64, cpus: Option<(usize, usize)>) -> f64 {
    // rtrb's capacity is exact; DPDK's 4096-slot ring holds 4095.
    pair(
        rtrb::RingBuffer::<u64>::new(RING_SIZE - 1),
        |p, items| p.push_entire_slice(items).is_ok(),
        |c, out| c.pop_entire_slice(out).is_ok(),
        burst,
        iterations,
        cpus,
    )
}

/// Parses the two-core SP/SC bulk lines (legacy 8-byte-element API) of `ring_perf_autotest`:
/// cycles per element (producer + consumer) for each burst.
fn parse_dpdk(text: &str) -> Vec<(usize, f64)> {
    let Some(start) = text.find("two physical cores") else { return Vec::new() };
    let section = &text[start..];
    let end = section.find("### Testing using all").unwrap_or(section.len());
    let mut found = Vec::new();
    for line in section[..end].lines() {
        let line = line.trim();
        // 22.11: "legacy APIs: SP/SC: bulk (size: 8): 150.07"; older: "SP/SC bulk enq/dequeue (size: 8): 150.07".
        let sp = line.starts_with("legacy APIs: SP/SC: bulk") || line.starts_with("SP/SC bulk enq/dequeue");
        if !sp {
            continue;
        }
        let Some((head, value)) = line.rsplit_once("):") else { continue };
        let Some(size) = head.rsplit_once("size:").and_then(|(_, s)| s.trim().parse().ok()) else { continue };
        if let Ok(v) = value.trim().parse::<f64>() {
            if !found.iter().any(|(s, _)| *s == size) {
                found.push((size, v));
            }
        }
    }
    found
}

/// Parses the one-lcore SP/SC bulk lines ("### Testing bulk enq/deq ###", legacy API). DPDK 22.11
/// and older print cycles per enqueue+dequeue of one whole burst; newer releases print cycles per
/// element. Returns cycles per element.
fn parse_dpdk_one_core(text: &str, dpdk_major: u32) -> Vec<(usize, f64)> {
    let Some(start) = text.find("### Testing bulk enq/deq ###") else { return Vec::new() };
    let section = &text[start..];
    let mut found = Vec::new();
    for line in section.lines().skip(1) {
        let line = line.trim();
        if line.starts_with("###") {
            break;
        }
        if !line.starts_with("legacy APIs: SP/SC: bulk") {
            continue;
        }
        let Some((head, value)) = line.rsplit_once("):") else { continue };
        let Some(size) = head.rsplit_once("size:").and_then(|(_, s)| s.trim().parse::<usize>().ok()) else {
            continue;
        };
        if let Ok(v) = value.trim().parse::<f64>() {
            let per_elem = if dpdk_major <= 22 { v / size as f64 } else { v };
            found.push((size, per_elem));
        }
    }
    found
}

/// The DPDK major version from the EAL banner ("RTE Version: 'DPDK 22.11.11'").
fn parse_dpdk_major(text: &str) -> Option<u32> {
    let at = text.find("RTE Version: 'DPDK ")? + "RTE Version: 'DPDK ".len();
    text[at..].split('.').next()?.parse().ok()
}

/// One `ring_perf_autotest` run: (two-core, one-core) cycles per element for each burst.
type DpdkRun = (Vec<(usize, f64)>, Vec<(usize, f64)>);

fn dpdk_once(cpus: Option<(usize, usize)>) -> anyhow::Result<DpdkRun> {
    let (a, b) = cpus.unwrap_or((0, 0));
    let mut child = Command::new("dpdk-test")
        .args(["--no-huge", "--no-pci", "--no-shconf", "-v", "-m", "512", "-l", &format!("{a},{b}")])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("starting dpdk-test")?;
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("piped stdin");
        stdin.write_all(b"ring_perf_autotest\nquit\n")?;
    }
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let found = parse_dpdk(&text);
    let major = parse_dpdk_major(&text).unwrap_or(22);
    let one = parse_dpdk_one_core(&text, major);
    if found.len() < BURSTS.len() {
        bail!(
            "could not find the two-core SP/SC lines in dpdk-test's output (exit {}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
        );
    }
    Ok((found, one))
}

/// A summary of a run's samples (median or minimum).
type Statistic = fn(&[f64]) -> Option<f64>;

/// The smallest sample (None when empty or any is NaN).
fn minimum(values: &[f64]) -> Option<f64> {
    if values.is_empty() || values.iter().any(|v| v.is_nan()) {
        return None;
    }
    values.iter().copied().reduce(f64::min)
}

/// Runs the comparison. Runs are interleaved (run 1 of every ring and of dpdk-test, then run 2...)
/// so that load changing over time on a shared machine biases no ring against another.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.runs == 0 || args.iterations == 0 || args.one_core_iterations == 0 {
        bail!("--runs, --iterations and --one-core-iterations must be positive");
    }
    let cpus = study::allowed_cpus();
    let pin = if cpus.len() >= 2 {
        println!("two-core rows: producer on CPU {}, consumer on CPU {}", cpus[0], cpus[1]);
        Some((cpus[0], cpus[1]))
    } else {
        println!("only one CPU available: the two-core rows run unpinned on it (not a two-core figure)");
        None
    };
    let have_dpdk = !args.no_dpdk && Command::new("dpdk-test").arg("--help").output().is_ok();
    if !have_dpdk {
        println!(
            "peer:rte_ring not measured: dpdk-test is not installed (it ships in Debian's dpdk-dev: \
             `apt-get install dpdk-dev`), or --no-dpdk was given"
        );
    }
    let hz = if have_dpdk {
        let hz = study::tsc_hz().context("the TSC frequency is needed to convert DPDK's cycles")?;
        println!("TSC at {:.3} GHz (measured)", hz / 1e9);
        hz
    } else {
        f64::NAN
    };
    // samples[ring][cores - 1][burst index], ns per element; ring 0 lanbus, 1 rtrb, 2 rte_ring.
    let mut samples = vec![vec![vec![Vec::<f64>::new(); BURSTS.len()]; 2]; 3];
    for run in 0..args.runs {
        for (k, &burst) in BURSTS.iter().enumerate() {
            let got = [
                (0, 1, lanbus_once(burst, args.iterations, pin)?),
                (1, 1, rtrb_once(burst, args.iterations, pin)),
                (0, 0, lanbus_one_core(burst, args.one_core_iterations)?),
                (1, 0, rtrb_one_core(burst, args.one_core_iterations)),
            ];
            for (ring, c, v) in got {
                samples[ring][c][k].push(v);
            }
            eprintln!(
                "  run {}/{} burst {burst}: two cores: lanbus {:.2}, rtrb {:.2} ns/elem; one core: lanbus {:.2}, rtrb {:.2} ns/elem",
                run + 1,
                args.runs,
                got[0].2,
                got[1].2,
                got[2].2,
                got[3].2
            );
        }
        if have_dpdk {
            eprintln!("  run {}/{} dpdk-test ring_perf_autotest (takes a while)", run + 1, args.runs);
            match dpdk_once(pin) {
                Ok((two, one)) => {
                    for (k, b) in BURSTS.iter().enumerate() {
                        for (c, found) in [(1, &two), (0, &one)] {
                            if let Some((_, v)) = found.iter().find(|(s, _)| s == b) {
                                samples[2][c][k].push(v / (hz / 1e9));
                            }
                        }
                    }
                }
                Err(e) => println!("dpdk-test run failed: {e:#}"),
            }
        }
    }
    let mut report = Report::new("ring");
    // The median is the headline; the minimum (the least disturbed window) is reported beside it
    // because on a shared machine a two-core window often loses one thread to another job.
    let stats: [(&str, &str, Statistic); 2] =
        [("ns_per_elem", "ratio_to_rte_ring", median), ("ns_per_elem_min", "ratio_to_rte_ring_min", minimum)];
    for (metric, ratio, stat) in stats {
        for cores in [2u64, 1] {
            for (k, &burst) in BURSTS.iter().enumerate() {
                let c = cores as usize - 1;
                let m: Vec<Option<f64>> = (0..3).map(|r| stat(&samples[r][c][k])).collect();
                for (r, name) in ["lanbus", "peer:rtrb", "peer:rte_ring"].iter().enumerate() {
                    if let Some(v) = m[r] {
                        report.push(
                            Row::new(*name, metric, v).with("burst", burst as u64).with("cores", cores),
                        );
                    }
                }
                if let (Some(ours), Some(rte)) = (m[0], m[2]) {
                    report.push(
                        Row::new("lanbus", ratio, ours / rte)
                            .with("burst", burst as u64)
                            .with("cores", cores),
                    );
                }
            }
        }
    }
    report.finish(args.json.as_deref())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_dpdk_22_output() {
        let text = "### Testing empty bulk deq ###\nlegacy APIs: SP/SC: bulk (size: 8): 26.61\n\
                    ### Testing using two physical cores ###\n\
                    legacy APIs: SP/SC: bulk (size: 8): 150.07\n\
                    legacy APIs: MP/MC: bulk (size: 8): 15732.16\n\
                    legacy APIs: SP/SC: bulk (size: 32): 34.74\n\
                    ### Testing using all worker nodes ###\n\
                    ### Testing using two physical cores ###\n\
                    elem APIs: element size 16B: SP/SC: bulk (size: 8): 28.10\n";
        assert_eq!(parse_dpdk(text), vec![(8, 150.07), (32, 34.74)]);
        assert_eq!(parse_dpdk("SP/SC bulk enq/dequeue (size: 8): 9.5"), vec![]);
        assert_eq!(
            parse_dpdk("two physical cores\nSP/SC bulk enq/dequeue (size: 8): 9.5\nSP/SC bulk enq/dequeue (size: 32): 3.25"),
            vec![(8, 9.5), (32, 3.25)]
        );
    }

    #[test]
    fn parses_dpdk_one_core_and_version() {
        let text = "EAL: RTE Version: 'DPDK 22.11.11'\n### Testing burst enq/deq ###\n\
                    legacy APIs: SP/SC: burst (size: 8): 1.0\n\
                    ### Testing bulk enq/deq ###\n\
                    legacy APIs: SP/SC: bulk (size: 8): 80.00\n\
                    legacy APIs: MP/MC: bulk (size: 8): 99.00\n\
                    legacy APIs: SP/SC: bulk (size: 32): 160.00\n\
                    ### Testing empty bulk deq ###\nlegacy APIs: SP/SC: bulk (size: 8): 1.0\n";
        assert_eq!(parse_dpdk_major(text), Some(22));
        assert_eq!(parse_dpdk_one_core(text, 22), vec![(8, 10.0), (32, 5.0)]);
        assert_eq!(parse_dpdk_one_core(text, 23), vec![(8, 80.0), (32, 160.0)]);
    }

    #[test]
    fn rings_agree_on_a_short_run() {
        assert!(lanbus_one_core(32, 1000).unwrap() > 0.0);
        assert!(rtrb_one_core(8, 1000) > 0.0);
        // Small, unpinned: checks the harness and the element checksum, not speed.
        assert!(lanbus_once(8, 2000, None).unwrap() > 0.0);
        assert!(rtrb_once(32, 500, None) > 0.0);
    }
}
