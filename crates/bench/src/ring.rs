//! `lanbus bench ring`: our SPSC ring against DPDK's rte_ring and the rtrb crate, across two cores.
//!
//! Method: the same as DPDK 22.11's `ring_perf_autotest` (`app/test/test_ring_perf.c`), "Testing
//! using two physical cores", legacy 8-byte-element SP/SC bulk API. DPDK creates a 4096-slot ring;
//! `run_on_core_pair` launches the dequeue loop on a worker lcore and runs the enqueue loop on the
//! main lcore (`enqueue_dequeue_bulk_helper`, 2^15 bulk operations of `burst` elements each).
//! Both threads first meet at a barrier (atomic add, then spin with `rte_pause` until the count is
//! 2), then each reads the TSC, loops retrying every failed (full/empty) attempt after one
//! `rte_pause` (never yielding, so failed attempts are inside the timed span), reads the TSC
//! again and computes cycles / (2^15 * burst); the printed figure is the sum of the two threads'.
//! We do the same: a 4096-slot ring of u64, warmed by one untimed pass (DPDK's ring was just
//! used by its one-lcore tests), DPDK's two lcores (the main thread pinned to the first CPU for the
//! whole run, one worker thread pinned to the second, asleep between runs; see [`Lcores`]), the
//! consumer launched on the worker and the producer run on the main thread, the same barrier, 2^15
//! bulk operations per thread, retry after `spin_loop` (PAUSE), `Instant` around the same span, and
//! the sum of producer and consumer ns/element. Our loop differs from DPDK's only in counting failed
//! attempts (one register increment beside each PAUSE) and in the consumer adding up the last
//! element of each burst (to check what arrived); DPDK's cycles are turned into ns with the TSC
//! frequency measured here. A 2^15-operation window lasts a few milliseconds, so on a machine
//! shared with other jobs a window often loses a thread to the scheduler: the bench runs every
//! ring `--runs` times, interleaved (run 1 of each ring and of dpdk-test, then run 2...), and
//! reports the median (`ns_per_elem`) and the least disturbed run (`ns_per_elem_min`);
//! `--sides` shows, per run and side, the failed attempts and whether the thread was descheduled.
//!
//! rte_ring is measured twice. `peer:rte_ring` runs `dpdk-test` (Debian package `dpdk-dev`) with
//! `ring_perf_autotest`: DPDK's own numbers; when it is missing the bench says how to install it.
//! `peer:rte_ring_shim` (built with `--features dpdk`, which needs Debian's `libdpdk-dev`) drives
//! the same rte_ring code through this harness's own loops and threads, so it differs from the
//! `lanbus` row in nothing but the ring (and a function call into C per operation, which DPDK's
//! test inlines). Rows `lanbus`, `peer:rte_ring`, `peer:rte_ring_shim`, `peer:rtrb`, metrics
//! `ns_per_elem` and `ns_per_elem_min`, params `burst` and `cores`; rows `lanbus` /
//! `ratio_to_rte_ring` (`_min`) (ours over dpdk-test's rte_ring; below 1 is better) and
//! `ratio_to_rte_ring_shim` (`_min`) (ours over the shim's). `cores=1` is
//! DPDK's one-lcore "bulk enq/deq" test (2^23 times enqueue a burst and dequeue it on one thread),
//! which load on the machine distorts far less.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
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
    /// Print each two-core run's sides: ns/element, failed (full/empty) attempts, and how often the
    /// thread was descheduled during its timed loop.
    #[arg(long)]
    pub sides: bool,
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
fn barrier(ready: &AtomicUsize) {
    // AcqRel: both threads start timing only once both are spinning.
    ready.fetch_add(1, Ordering::AcqRel);
    while ready.load(Ordering::Acquire) < 2 {
        std::hint::spin_loop();
    }
}

/// A function handed to the worker lcore.
type Job = Box<dyn FnOnce() + Send>;

/// The two threads of DPDK's lcore model, in which `ring_perf_autotest` runs: the main lcore is
/// the main thread, pinned to the first CPU for the whole run (EAL pins it at init); the worker
/// lcore is a thread made once, pinned to the second CPU and asleep (DPDK: blocked reading a pipe)
/// until `rte_eal_remote_launch` hands it a function. The two-core test launches the dequeue loop
/// on the worker, then runs the enqueue loop on the main lcore. Every two-core run of every ring
/// here uses the same two threads that way (an earlier harness spawned a fresh thread per run and
/// pinned it inside the timed run's setup; DPDK's threads are pinned long before).
struct Lcores {
    launch: Option<mpsc::Sender<Job>>,
    worker: Option<std::thread::JoinHandle<()>>,
    /// (main, worker) CPUs; None when there is only one.
    cpus: Option<(usize, usize)>,
    /// The main thread's CPUs before pinning (restored for child processes).
    all_cpus: Vec<usize>,
}

impl Lcores {
    fn new(cpus: Option<(usize, usize)>, all_cpus: Vec<usize>) -> Self {
        if let Some((main, _)) = cpus {
            study::pin_current_thread(main);
        }
        let (launch, jobs) = mpsc::channel::<Job>();
        let worker = std::thread::Builder::new()
            .name("worker-lcore".into())
            .spawn(move || {
                if let Some((_, w)) = cpus {
                    study::pin_current_thread(w);
                }
                for job in jobs {
                    job();
                }
            })
            .expect("spawning the worker lcore thread");
        Lcores { launch: Some(launch), worker: Some(worker), cpus, all_cpus }
    }

    /// Runs `f` on the worker lcore; its result arrives on the returned channel.
    fn remote_launch<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> mpsc::Receiver<R> {
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move || {
            // The receiver only goes away if the main thread panicked.
            let _ = tx.send(f());
        });
        self.launch.as_ref().expect("worker lcore running").send(job).expect("worker lcore alive");
        rx
    }

    /// Runs `f` (which starts child processes) with the main thread unpinned, so children do not
    /// inherit the main lcore's pinning.
    fn unpinned<R>(&self, f: impl FnOnce() -> R) -> R {
        if self.cpus.is_some() {
            study::set_current_thread_cpus(&self.all_cpus);
        }
        let r = f();
        if let Some((main, _)) = self.cpus {
            study::pin_current_thread(main);
        }
        r
    }
}

impl Drop for Lcores {
    fn drop(&mut self) {
        self.launch.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
        if self.cpus.is_some() {
            study::set_current_thread_cpus(&self.all_cpus);
        }
    }
}

/// Runs producer and consumer exactly as DPDK's two-core SP/SC bulk test: the consumer on the
/// worker lcore, the producer on the main lcore (see [`Lcores`]); each thread times `iterations`
/// bulk operations of `burst` elements, retrying a failed (full or empty) attempt after a pause
/// hint without yielding, so failed attempts count in its time; the figure is the sum of the
/// producer's and the consumer's ns/element (DPDK prints the sum of its threads' cycles/element).
/// `enqueue`/`dequeue` are monomorphised into the loops (no indirect call).
fn pair<P, C, E, D>(
    lcores: &Lcores,
    (mut p, mut c): (P, C),
    enqueue: E,
    dequeue: D,
    burst: usize,
    iterations: u64,
) -> Pair
where
    C: Send + 'static,
    E: Fn(&mut P, &[u64]) -> bool + Copy,
    D: Fn(&mut C, &mut [u64]) -> bool + Copy + Send + 'static,
{
    warm(&mut p, &mut c, enqueue, dequeue);
    let ready = Arc::new(AtomicUsize::new(0));
    let r2 = ready.clone();
    let consumer = lcores.remote_launch(move || {
        // Both sides' buffers on their own threads' stacks.
        let mut out_all = [0u64; 32];
        let out = &mut out_all[..burst];
        let mut check = 0u64;
        barrier(&r2);
        let switches = study::thread_context_switches();
        let mut failed = 0u64;
        let t0 = Instant::now();
        for _ in 0..iterations {
            while !dequeue(&mut c, out) {
                failed += 1;
                std::hint::spin_loop();
            }
            check = check.wrapping_add(out[burst - 1]);
        }
        let ns = t0.elapsed().as_nanos() as f64 / (iterations as f64 * burst as f64);
        (Side { ns, failed, switches: study::thread_context_switches() - switches }, check)
    });
    let mut all = [0u64; 32];
    all.iter_mut().enumerate().for_each(|(k, v)| *v = k as u64);
    let items = &all[..burst];
    barrier(&ready);
    let switches = study::thread_context_switches();
    let mut failed = 0u64;
    let t0 = Instant::now();
    for _ in 0..iterations {
        while !enqueue(&mut p, items) {
            failed += 1;
            std::hint::spin_loop();
        }
    }
    let ns = t0.elapsed().as_nanos() as f64 / (iterations as f64 * burst as f64);
    let producer = Side { ns, failed, switches: study::thread_context_switches() - switches };
    let (consumer, check) = consumer.recv().expect("consumer on the worker lcore");
    assert_eq!(check, iterations * (burst as u64 - 1), "ring delivered wrong elements");
    Pair { producer, consumer }
}

/// One thread's result in a two-core run.
#[derive(Debug, Clone, Copy)]
struct Side {
    /// Its own time per element.
    ns: f64,
    /// Attempts that found the ring full (producer) or empty (consumer), each followed by a pause.
    failed: u64,
    /// Times it was descheduled during its timed loop.
    switches: u64,
}

/// A two-core run: the figure DPDK prints is `producer.ns + consumer.ns`.
#[derive(Debug, Clone, Copy)]
struct Pair {
    producer: Side,
    consumer: Side,
}

impl Pair {
    fn ns(&self) -> f64 {
        self.producer.ns + self.consumer.ns
    }
}

impl std::fmt::Display for Pair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (p, c) = (self.producer, self.consumer);
        write!(
            f,
            "{:.2} (producer {:.2} ns, {} full, {} switches; consumer {:.2} ns, {} empty, {} switches)",
            self.ns(),
            p.ns,
            p.failed,
            p.switches,
            c.ns,
            c.failed,
            c.switches
        )
    }
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

#[cfg(feature = "dpdk")]
fn rte_one_core(burst: usize, iterations: u64) -> anyhow::Result<f64> {
    Ok(one_core(
        lanbus_ring::rte::channel(RING_SIZE as u32)?,
        |p, items| p.enqueue_bulk(items),
        |c, out| c.dequeue_bulk(out),
        burst,
        iterations,
    ))
}

/// rte_ring driven through this harness's own loop (the shim of the `dpdk` feature): the same
/// loop, threads, pinning and timing as the `lanbus` and `rtrb` rows, so any difference left is the
/// ring's.
#[cfg(feature = "dpdk")]
fn rte_once(lcores: &Lcores, burst: usize, iterations: u64) -> anyhow::Result<Pair> {
    Ok(pair(
        lcores,
        lanbus_ring::rte::channel(RING_SIZE as u32)?,
        |p, items| p.enqueue_bulk(items),
        |c, out| c.dequeue_bulk(out),
        burst,
        iterations,
    ))
}

fn lanbus_once(lcores: &Lcores, burst: usize, iterations: u64) -> anyhow::Result<Pair> {
    let ends = lanbus_ring::channel::<u64>(RING_SIZE as u32)?;
    Ok(pair(
        lcores,
        ends,
        |p, items| p.enqueue_bulk(items).expect("in-process ring cannot be corrupted"),
        |c, out| c.dequeue_bulk(out).expect("in-process ring cannot be corrupted"),
        burst,
        iterations,
    ))
}

fn rtrb_once(lcores: &Lcores, burst: usize, iterations: u64) -> Pair {
    // rtrb's capacity is exact; DPDK's 4096-slot ring holds 4095.
    pair(
        lcores,
        rtrb::RingBuffer::<u64>::new(RING_SIZE - 1),
        |p, items| p.push_entire_slice(items).is_ok(),
        |c, out| c.pop_entire_slice(out).is_ok(),
        burst,
        iterations,
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

/// Report rows, indexed by the constants below.
const ROWS: [&str; 4] = ["lanbus", "peer:rtrb", "peer:rte_ring", "peer:rte_ring_shim"];
const LANBUS: usize = 0;
const RTRB: usize = 1;
/// rte_ring as measured by `dpdk-test` itself.
const RTE_TEST: usize = 2;
/// rte_ring driven by this harness through the `dpdk` feature's shim.
const SHIM_ROW: usize = 3;
#[cfg(feature = "dpdk")]
const RTE_SHIM: usize = SHIM_ROW;

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
    let lcores = Lcores::new(pin, cpus.clone());
    // samples[ring][cores - 1][burst index], ns per element; rings as in ROWS.
    let mut samples = vec![vec![vec![Vec::<f64>::new(); BURSTS.len()]; 2]; ROWS.len()];
    for run in 0..args.runs {
        for (k, &burst) in BURSTS.iter().enumerate() {
            #[cfg_attr(not(feature = "dpdk"), allow(unused_mut))] // the shim row is pushed with `dpdk`
            let mut two = vec![
                (LANBUS, lanbus_once(&lcores, burst, args.iterations)?),
                (RTRB, rtrb_once(&lcores, burst, args.iterations)),
            ];
            #[cfg(feature = "dpdk")]
            two.push((RTE_SHIM, rte_once(&lcores, burst, args.iterations)?));
            #[cfg_attr(not(feature = "dpdk"), allow(unused_mut))]
            let mut one = vec![
                (LANBUS, lanbus_one_core(burst, args.one_core_iterations)?),
                (RTRB, rtrb_one_core(burst, args.one_core_iterations)),
            ];
            #[cfg(feature = "dpdk")]
            one.push((RTE_SHIM, rte_one_core(burst, args.one_core_iterations)?));
            let mut line = format!("  run {}/{} burst {burst}:", run + 1, args.runs);
            for &(ring, pair) in &two {
                samples[ring][1][k].push(pair.ns());
                line += &format!(" {} 2-core {:.2};", ROWS[ring], pair.ns());
            }
            for &(ring, v) in &one {
                samples[ring][0][k].push(v);
                line += &format!(" {} 1-core {v:.2};", ROWS[ring]);
            }
            eprintln!("{line} ns/elem");
            if args.sides {
                for (ring, pair) in two {
                    eprintln!("    {} 2-core: {pair}", ROWS[ring]);
                }
            }
        }
        if have_dpdk {
            eprintln!("  run {}/{} dpdk-test ring_perf_autotest (takes a while)", run + 1, args.runs);
            match lcores.unpinned(|| dpdk_once(pin)) {
                Ok((two, one)) => {
                    for (k, b) in BURSTS.iter().enumerate() {
                        for (c, found) in [(1, &two), (0, &one)] {
                            if let Some((_, v)) = found.iter().find(|(s, _)| s == b) {
                                samples[RTE_TEST][c][k].push(v / (hz / 1e9));
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
                let m: Vec<Option<f64>> = (0..ROWS.len()).map(|r| stat(&samples[r][c][k])).collect();
                for (r, name) in ROWS.iter().enumerate() {
                    if let Some(v) = m[r] {
                        report.push(
                            Row::new(*name, metric, v).with("burst", burst as u64).with("cores", cores),
                        );
                    }
                }
                // Ours over dpdk-test's figure, and over rte_ring in this harness.
                for (peer, ratio) in
                    [(RTE_TEST, ratio.to_string()), (SHIM_ROW, ratio.replace("ring", "ring_shim"))]
                {
                    if let (Some(ours), Some(rte)) = (m[LANBUS], m[peer]) {
                        report.push(
                            Row::new("lanbus", ratio, ours / rte)
                                .with("burst", burst as u64)
                                .with("cores", cores),
                        );
                    }
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
        let lcores = Lcores::new(None, Vec::new());
        assert!(lanbus_once(&lcores, 8, 2000).unwrap().ns() > 0.0);
        assert!(rtrb_once(&lcores, 32, 500).ns() > 0.0);
        #[cfg(feature = "dpdk")]
        {
            assert!(rte_one_core(8, 1000).unwrap() > 0.0);
            assert!(rte_once(&lcores, 32, 500).unwrap().ns() > 0.0);
        }
    }
}
