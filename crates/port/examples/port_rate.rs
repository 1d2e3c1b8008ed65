//! Raw one-way frame rate of each port over a veth pair between two namespaces (needs root): the
//! ceiling a reliable stream on top can reach, and so the largest goodput ratio between two ports
//! that any transport could show on this link. A sender thread fills full bursts and a receiver
//! thread drains, both spinning; the rate is what the receiver got. Prints frames/s, Gbit/s of
//! frame bytes and each port's ratio to `udp`, for every frame size, median of the runs.
//!
//! ```text
//! cargo run --release -p lanbus-port --example port_rate [SECONDS] [MTU] [FRAME_BYTES...]
//! ```
//! Defaults: 1 second per run, 3 runs, MTU 1500, frames of 92 and 1514 bytes (Ethernet header
//! included; the udp port's frames are 28 bytes shorter, so that with its IP and UDP headers the
//! same bytes cross the veth).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanbus_port::netns::VethPair;
use lanbus_port::Port;

const RUNS: usize = 3;
const BURST: usize = 32;

/// Frames per second the receiver got while the sender spun for `secs`.
fn one_way(mut a: Box<dyn Port>, mut b: Box<dyn Port>, len: usize, secs: f64) -> f64 {
    let mut frame = vec![0u8; len];
    frame[0..6].copy_from_slice(&b.mac().0);
    frame[6..12].copy_from_slice(&a.mac().0);
    frame[12..14].copy_from_slice(&0x88b5u16.to_be_bytes());
    let stop = Arc::new(AtomicBool::new(false));
    let stop_rx = stop.clone();
    let receiver = std::thread::spawn(move || {
        let mut frames = 0u64;
        // Relaxed: a plain stop flag; the join orders everything else.
        while !stop_rx.load(Ordering::Relaxed) {
            frames += b.rx_burst(BURST, &mut |_| {}).unwrap() as u64;
        }
        frames
    });
    // Let the receiver start spinning and the first frames warm the path.
    std::thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    while Instant::now() < end {
        a.tx_burst(BURST, &mut |buf| {
            buf[..frame.len()].copy_from_slice(&frame);
            Some(frame.len())
        })
        .unwrap();
    }
    let sending = start.elapsed().as_secs_f64();
    // Frames still in flight when the sender stops count: the receiver drains them within 20 ms.
    std::thread::sleep(Duration::from_millis(20));
    stop.store(true, Ordering::Relaxed);
    let received = receiver.join().unwrap();
    received as f64 / sending
}

fn main() {
    let mut args = std::env::args().skip(1);
    let secs: f64 = args.next().map_or(1.0, |s| s.parse().expect("SECONDS is a number"));
    let mtu: usize = args.next().map_or(1500, |s| s.parse().expect("MTU is a number"));
    let mut sizes: Vec<usize> = args.map(|s| s.parse().expect("FRAME_BYTES are numbers")).collect();
    if sizes.is_empty() {
        sizes = vec![92, mtu + 14];
    }
    for &size in &sizes {
        assert!((88..=mtu + 14).contains(&size), "frames are 88..=MTU+14 bytes");
    }
    let pair = match VethPair::create() {
        Ok(p) => p,
        Err(skip) => {
            eprintln!("port_rate {skip}");
            std::process::exit(2);
        }
    };
    pair.set_mtu(mtu).expect("set the veth MTU");
    let (ip_a, ip_b, if_a, if_b) = (pair.a.ipv4, pair.b.ipv4, pair.a.ifname.clone(), pair.b.ifname.clone());
    let udp_mtu = format!("mtu={}", mtu - 28);
    let configs = [
        (
            "udp",
            format!("udp:{ip_a}:7000,peer={ip_b}:7000,{udp_mtu}"),
            format!("udp:{ip_b}:7000,peer={ip_a}:7000,{udp_mtu}"),
        ),
        ("afpacket", format!("afpacket:{if_a}"), format!("afpacket:{if_b}")),
        ("afxdp", format!("afxdp:{if_a}"), format!("afxdp:{if_b}")),
    ];
    println!("one way a -> b over a veth at MTU {mtu}, {secs} s per run, median of {RUNS} runs");
    println!("{:<10} {:>7} {:>12} {:>9} {:>8}", "port", "frame_B", "Mframes/s", "Gbit/s", "vs_udp");
    for &size in &sizes {
        let mut udp_rate = None;
        for (name, spec_a, spec_b) in &configs {
            let mut rates = Vec::with_capacity(RUNS);
            for _ in 0..RUNS {
                let (sa, sb) = (spec_a.clone(), spec_b.clone());
                let a = pair
                    .a
                    .netns
                    .run(move || sa.parse::<lanbus_port::PortSpec>().and_then(|s| s.open()))
                    .unwrap()
                    .unwrap();
                let b = pair
                    .b
                    .netns
                    .run(move || sb.parse::<lanbus_port::PortSpec>().and_then(|s| s.open()))
                    .unwrap()
                    .unwrap();
                // Same bytes on the wire: the udp port's IP and UDP headers stand in for 28 of them.
                let len = if *name == "udp" { size - 28 } else { size };
                rates.push(one_way(a, b, len, secs));
            }
            rates.sort_by(f64::total_cmp);
            let rate = rates[RUNS / 2];
            let udp = *udp_rate.get_or_insert(rate);
            println!(
                "{name:<10} {size:>7} {:>12.3} {:>9.2} {:>7.2}x",
                rate / 1e6,
                rate * size as f64 * 8.0 / 1e9,
                rate / udp
            );
        }
    }
}
