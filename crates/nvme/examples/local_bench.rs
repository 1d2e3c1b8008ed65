//! Quick throughput of the in-process driver + controller model (no fabric, no NBD): random
//! reads and writes, one thread, one request in flight, block sizes 4 KiB to 1 MiB, over a
//! 64 MiB RAM namespace. The `local` row of `lanbus bench nvme` builds on the same join.
//!
//! `cargo run --release -p lanbus-nvme --example local_bench [seconds-per-point]`

use lanbus_nvme::local::{LocalNvme, ProcessMode};
use lanbus_nvme::{CompletionMode, Controller, ControllerConfig, DriverConfig, RamBacking};
use std::time::{Duration, Instant};

fn main() {
    let secs: f64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0.5);
    let size: u64 = 64 << 20;
    println!("{:<22} {:>8} {:>10} {:>10} {:>10}", "mode", "bs", "rw", "MB/s", "IOPS");
    for (name, mode, completion) in [
        ("inline+interrupt", ProcessMode::Inline, CompletionMode::Interrupt),
        ("thread+interrupt", ProcessMode::Thread, CompletionMode::Interrupt),
        ("thread+poll", ProcessMode::Thread, CompletionMode::Poll),
    ] {
        let ctrl = Controller::new(
            ControllerConfig { lba_size: 512, ..ControllerConfig::default() },
            Box::new(RamBacking::new(size)),
        )
        .expect("controller");
        let local = LocalNvme::new(ctrl, 16384, mode);
        let drv = local
            .driver(DriverConfig { io_queues: 1, completion, ..DriverConfig::default() })
            .expect("driver");
        for bs in [4096usize, 16384, 65536, 262144, 1 << 20] {
            for write in [false, true] {
                let mut buf = vec![0x5Au8; bs];
                let slots = size / bs as u64;
                let mut x: u64 = 0x2545_F491_4F6C_DD1D;
                let (mut ops, start) = (0u64, Instant::now());
                while start.elapsed() < Duration::from_secs_f64(secs) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let off = (x % slots) * bs as u64;
                    if write {
                        drv.write_at(off, &buf, false).expect("write");
                    } else {
                        drv.read_at(off, &mut buf).expect("read");
                    }
                    ops += 1;
                }
                let t = start.elapsed().as_secs_f64();
                let rw = if write { "randwrite" } else { "randread" };
                let mbps = ops as f64 * bs as f64 / t / 1e6;
                println!("{name:<22} {bs:>8} {rw:>10} {mbps:>10.1} {:>10.0}", ops as f64 / t);
            }
        }
    }
}
