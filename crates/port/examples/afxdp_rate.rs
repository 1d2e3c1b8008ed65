//! Quick numbers for the AF_XDP port over a veth pair between two namespaces (root only):
//! one-way frame rate for 64-byte frames (a sender thread and a receiver thread, both spinning)
//! and busy-polled ping-pong round trips.
//!
//! `cargo run --release -p lanbus-port --example afxdp_rate [seconds] [busy]` (`busy`: open both
//! sockets with busy polling, 20 us, budget 64)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanbus_port::afxdp::{open, AfXdpOptions, BusyPoll};
use lanbus_port::netns::VethPair;
use lanbus_port::Port;

fn main() {
    let secs: u64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(3);
    let pair = match VethPair::create() {
        Ok(p) => p,
        Err(skip) => {
            eprintln!("afxdp_rate {skip}");
            return;
        }
    };
    let mut options = AfXdpOptions::default();
    if std::env::args().nth(2).as_deref() == Some("busy") {
        options.busy_poll = Some(BusyPoll { usecs: 20, budget: 64 });
    }
    let (a_if, b_if) = (pair.a.ifname.clone(), pair.b.ifname.clone());
    let mut a = pair.a.netns.run(move || open(&a_if, 0, &options)).unwrap().unwrap();
    let mut b = pair.b.netns.run(move || open(&b_if, 0, &options)).unwrap().unwrap();
    println!("xdp mode {:?}, bind mode {:?}, busy poll {:?}", a.xdp_mode(), a.bind_mode(), options.busy_poll);
    let mut template = [0u8; 64];
    template[..6].copy_from_slice(&pair.b.mac.0);
    template[6..12].copy_from_slice(&pair.a.mac.0);
    template[12..14].copy_from_slice(&[0x88, 0xB5]);

    // One way: a -> b for `secs` seconds.
    let stop = Arc::new(AtomicBool::new(false));
    let stop_rx = stop.clone();
    let receiver = std::thread::spawn(move || {
        let mut frames = 0u64;
        // Relaxed: a plain stop flag; the join below orders everything else.
        while !stop_rx.load(Ordering::Relaxed) {
            frames += b.rx_burst(64, &mut |_| {}).unwrap() as u64;
        }
        (b, frames)
    });
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < Duration::from_secs(secs) {
        sent += a
            .tx_burst(64, &mut |buf| {
                buf[..64].copy_from_slice(&template);
                Some(64)
            })
            .unwrap() as u64;
    }
    let elapsed = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::Relaxed);
    let (mut b, received) = receiver.join().unwrap();
    println!(
        "one way, 64 B frames: sent {:.3} Mframes/s, received {:.3} Mframes/s ({} of {} frames; b's rx_dropped {})",
        sent as f64 / elapsed / 1e6,
        received as f64 / elapsed / 1e6,
        received,
        sent,
        b.counters().rx_dropped
    );

    // Ping-pong: a sends one frame, b echoes it; both spinning, then both blocking in wait().
    let mut echo = template;
    echo[..6].copy_from_slice(&pair.a.mac.0);
    echo[6..12].copy_from_slice(&pair.b.mac.0);
    for blocking in [false, true] {
        let stop_echo = Arc::new(AtomicBool::new(false));
        let stop_b = stop_echo.clone();
        let echoer = std::thread::spawn(move || {
            // Relaxed: a plain stop flag; the join orders the rest.
            while !stop_b.load(Ordering::Relaxed) {
                if blocking {
                    b.wait(Some(Duration::from_millis(10))).unwrap();
                }
                let n = b.rx_burst(64, &mut |_| {}).unwrap();
                for _ in 0..n {
                    while b.send_frames(&[&echo]).unwrap() == 0 {}
                }
            }
            b
        });
        let mut rtts = Vec::new();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(secs) {
            let t0 = Instant::now();
            while a.send_frames(&[&template]).unwrap() == 0 {}
            let give_up = t0 + Duration::from_millis(100);
            loop {
                if blocking {
                    a.wait(Some(Duration::from_millis(10))).unwrap();
                }
                if a.rx_burst(1, &mut |_| {}).unwrap() > 0 || Instant::now() > give_up {
                    break;
                }
            }
            rtts.push(t0.elapsed());
        }
        stop_echo.store(true, Ordering::Relaxed);
        b = echoer.join().unwrap();
        rtts.sort();
        let pct = |p: f64| rtts[((rtts.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6;
        let mode = if blocking { "both blocking in wait()" } else { "both spinning" };
        println!(
            "ping-pong, 64 B, {mode}: {} round trips, p50 {:.1} us, p99 {:.1} us",
            rtts.len(),
            pct(0.5),
            pct(0.99)
        );
    }
}
