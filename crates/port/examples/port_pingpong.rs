//! Raw port ping-pong over a veth pair between two namespaces (needs root): a quick look at what
//! each port costs per round trip before the transport is on top. One thread per namespace; the
//! echo side bounces every frame back. Prints p50/p99 in microseconds per port and polling mode.
//!
//! ```text
//! cargo run --release -p lanbus-port --example port_pingpong [ROUNDS] [PAYLOAD]
//! ```
//! Busy mode spins on rx_burst; blocking mode calls `wait` when idle. On a machine with fewer than
//! two free cores busy mode measures the scheduler, not the port.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanbus_port::netns::VethPair;
use lanbus_port::Port;
use lanbus_wire::ethernet::HEADER_LEN;

fn frame(dst: [u8; 6], src: [u8; 6], seq: u32, len: usize) -> Vec<u8> {
    let mut f = vec![0u8; HEADER_LEN + len];
    f[0..6].copy_from_slice(&dst);
    f[6..12].copy_from_slice(&src);
    f[12..14].copy_from_slice(&0x88b5u16.to_be_bytes());
    f[14..18].copy_from_slice(&seq.to_be_bytes());
    f
}

fn pingpong(
    mut a: Box<dyn Port>,
    mut b: Box<dyn Port>,
    busy: bool,
    rounds: usize,
    payload: usize,
) -> (f64, f64) {
    let (a_mac, b_mac) = (a.mac().0, b.mac().0);
    let stop = Arc::new(AtomicBool::new(false));
    let stop_echo = stop.clone();
    let echo = std::thread::spawn(move || {
        let mut bounced = Vec::with_capacity(32);
        // Relaxed: only the eventual stop matters; no data is published through the flag.
        while !stop_echo.load(Ordering::Relaxed) {
            bounced.clear();
            b.rx_burst(32, &mut |f| bounced.push(f.to_vec())).unwrap();
            if bounced.is_empty() {
                if !busy {
                    b.wait(Some(Duration::from_millis(5))).unwrap();
                }
                continue;
            }
            for f in &mut bounced {
                f[0..6].copy_from_slice(&a_mac);
                f[6..12].copy_from_slice(&b_mac);
                while b.send_frames(&[f.as_slice()]).unwrap() == 0 {}
            }
        }
    });
    let mut micros = Vec::with_capacity(rounds);
    for seq in 0..rounds as u32 + 100 {
        let f = frame(b_mac, a_mac, seq, payload);
        let start = Instant::now();
        while a.send_frames(&[&f]).unwrap() == 0 {}
        loop {
            if a.rx_burst(1, &mut |_| {}).unwrap() == 1 {
                break;
            }
            if !busy {
                a.wait(Some(Duration::from_millis(5))).unwrap();
            }
        }
        // The first 100 rounds warm caches, ARP and the rings.
        if seq >= 100 {
            micros.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    stop.store(true, Ordering::Relaxed);
    echo.join().unwrap();
    micros.sort_by(|x, y| x.total_cmp(y));
    (micros[micros.len() / 2], micros[micros.len() * 99 / 100])
}

fn main() {
    let rounds: usize = std::env::args().nth(1).map_or(5000, |s| s.parse().expect("ROUNDS is a number"));
    let payload: usize = std::env::args().nth(2).map_or(64, |s| s.parse().expect("PAYLOAD is a number"));
    assert!((4..=1400).contains(&payload), "PAYLOAD is 4..=1400 bytes");
    let pair = match VethPair::create() {
        Ok(p) => p,
        Err(skip) => {
            eprintln!("port_pingpong {skip}");
            std::process::exit(2);
        }
    };
    let (ip_a, ip_b, if_a, if_b) = (pair.a.ipv4, pair.b.ipv4, pair.a.ifname.clone(), pair.b.ifname.clone());
    let configs = [
        ("udp", format!("udp:{ip_a}:7000,peer={ip_b}:7000"), format!("udp:{ip_b}:7000,peer={ip_a}:7000")),
        ("afpacket", format!("afpacket:{if_a}"), format!("afpacket:{if_b}")),
        ("afxdp", format!("afxdp:{if_a}"), format!("afxdp:{if_b}")),
    ];
    println!(
        "{:<16} {:<9} {:>9} {:>9}   ({payload}-byte payload, {rounds} round trips)",
        "port", "mode", "p50_us", "p99_us"
    );
    for (name, spec_a, spec_b) in configs {
        for busy in [true, false] {
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
            let (p50, p99) = pingpong(a, b, busy, rounds, payload);
            let mode = if busy { "busy" } else { "blocking" };
            println!("{name:<16} {mode:<9} {p50:>9.1} {p99:>9.1}");
        }
    }
}
