//! Quick numbers for the DPDK port over a veth pair between two namespaces (root only): the DPDK
//! port on end a (a DPDK virtual device on the veth, no hugepages), the AF_XDP port on end b.
//! One-way frame rates for 64-byte frames each way (a sender thread and a receiver thread, both
//! spinning) and ping-pong round trips (a's DPDK port sends, b echoes), spinning and with `wait()`.
//!
//! `cargo run --release -p lanbus-port --features dpdk --example dpdk_rate [seconds] [vdev]`, vdev
//! `af_packet` (default: DPDK's `net_af_packet`) or another DPDK vdev taking `iface=` (`af_xdp`:
//! DPDK's `net_af_xdp`, which attaches its own XDP program to a's veth; on a veth without
//! hugepages it has been seen to receive only a small fraction of the frames sent to it).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanbus_port::afxdp::{self, AfXdpOptions};
use lanbus_port::dpdk::{self, DpdkOptions};
use lanbus_port::netns::VethPair;
use lanbus_port::Port;

/// Sends 64-byte copies of `template` from `tx` for `secs` while a thread counts what `rx` gets.
/// Returns both ports and prints the rates.
fn one_way<A: Port + 'static, B: Port + 'static>(
    label: &str,
    mut tx: A,
    rx: B,
    template: [u8; 64],
    secs: u64,
) -> (A, B) {
    let stop = Arc::new(AtomicBool::new(false));
    let stop_rx = stop.clone();
    let receiver = std::thread::spawn(move || {
        let mut rx = rx;
        let mut frames = 0u64;
        // Relaxed: a plain stop flag; the join below orders everything else.
        while !stop_rx.load(Ordering::Relaxed) {
            frames += rx.rx_burst(64, &mut |_| {}).unwrap() as u64;
        }
        (rx, frames)
    });
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < Duration::from_secs(secs) {
        sent += tx
            .tx_burst(64, &mut |buf| {
                buf[..64].copy_from_slice(&template);
                Some(64)
            })
            .unwrap() as u64;
    }
    let elapsed = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::Relaxed);
    let (rx, received) = receiver.join().unwrap();
    println!(
        "{label}, 64 B frames: sent {:.3} Mframes/s, received {:.3} Mframes/s ({received} of {sent})",
        sent as f64 / elapsed / 1e6,
        received as f64 / elapsed / 1e6,
    );
    (tx, rx)
}

fn main() {
    let secs: u64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(3);
    let vdev = std::env::args().nth(2).unwrap_or_else(|| "af_packet".into());
    let pair = match VethPair::create() {
        Ok(p) => p,
        Err(skip) => {
            eprintln!("dpdk_rate {skip}");
            return;
        }
    };
    let eal_args = format!(
        "--no-huge --no-pci -m 256 --no-shconf --no-telemetry --file-prefix=lanbus-rate-{} -l 0 \
         --log-level=notice --vdev=net_{vdev}0,iface={}",
        std::process::id(),
        pair.a.ifname
    );
    println!("EAL arguments: {eal_args}");
    let args = eal_args.clone();
    let a = pair.a.netns.run(move || dpdk::open(&args, DpdkOptions::default())).unwrap().unwrap();
    let b_if = pair.b.ifname.clone();
    let b = pair.b.netns.run(move || afxdp::open(&b_if, 0, &AfXdpOptions::default())).unwrap().unwrap();
    println!("a: {a:?} (DPDK {})", dpdk::DPDK_VERSION);
    let mut a_to_b = [0u8; 64];
    a_to_b[..6].copy_from_slice(&pair.b.mac.0);
    a_to_b[6..12].copy_from_slice(&pair.a.mac.0);
    a_to_b[12..14].copy_from_slice(&[0x88, 0xB5]);
    let mut b_to_a = a_to_b;
    b_to_a[..6].copy_from_slice(&pair.a.mac.0);
    b_to_a[6..12].copy_from_slice(&pair.b.mac.0);

    let (a, b) = one_way("one way dpdk a -> afxdp b", a, b, a_to_b, secs);
    let (mut b, mut a) = one_way("one way afxdp b -> dpdk a", b, a, b_to_a, secs);

    for blocking in [false, true] {
        let stop = Arc::new(AtomicBool::new(false));
        let stop_b = stop.clone();
        let echoer = std::thread::spawn(move || {
            // Relaxed: a plain stop flag; the join orders the rest.
            while !stop_b.load(Ordering::Relaxed) {
                if blocking {
                    b.wait(Some(Duration::from_millis(10))).unwrap();
                }
                let n = b.rx_burst(64, &mut |_| {}).unwrap();
                for _ in 0..n {
                    while b.send_frames(&[&b_to_a]).unwrap() == 0 {}
                }
            }
            b
        });
        // Let the echoer start before timing.
        std::thread::sleep(Duration::from_millis(20));
        let mut rtts = Vec::new();
        let mut lost = 0;
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(secs) {
            let t0 = Instant::now();
            while a.send_frames(&[&a_to_b]).unwrap() == 0 {}
            let give_up = t0 + Duration::from_millis(100);
            loop {
                if blocking {
                    a.wait(Some(Duration::from_millis(10))).unwrap();
                }
                if a.rx_burst(1, &mut |_| {}).unwrap() > 0 {
                    rtts.push(t0.elapsed());
                    break;
                }
                if Instant::now() > give_up {
                    lost += 1;
                    break;
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        b = echoer.join().unwrap();
        rtts.sort();
        let pct = |p: f64| match rtts.len() {
            0 => f64::NAN,
            n => rtts[((n - 1) as f64 * p) as usize].as_secs_f64() * 1e6,
        };
        let mode = if blocking { "both in wait() when idle" } else { "both spinning" };
        println!(
            "ping-pong dpdk a <-> afxdp b, 64 B, {mode}: {} round trips ({lost} lost), p50 {:.1} us, p99 {:.1} us",
            rtts.len(),
            pct(0.5),
            pct(0.99)
        );
    }
    println!("a counters {:?}\na device {:?}", a.counters(), a.device_stats().unwrap());
    drop(a);
    let _ = std::fs::remove_dir(format!("/var/run/dpdk/lanbus-rate-{}", std::process::id()));
}
