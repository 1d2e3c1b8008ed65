//! The floor under daemon mode's latency (`raw:relay`): what a message's two extra hand-offs cost
//! on this machine with every lanbus layer taken out.
//!
//! In daemon mode a message goes from the sending process to its node's daemon thread through a
//! shared-memory ring, from that thread to the other node's daemon thread (over the port), and from
//! there to the receiving process through another ring: two hand-offs between threads more than in
//! direct mode, where the two processes talk to each other. With two ranks and two daemons polling
//! on a machine of two cores, each hand-off waits for the core to pass from one polling thread to
//! the other. This measures exactly that and nothing else: threads that only move a small record
//! through the same rings ([`lanbus_ring::pipe`]), each yielding its core after every empty look
//! as the daemon's runtime thread and its clients do:
//!
//! - *pair*: two threads ping-pong a record through two rings (direct mode's shape);
//! - *relay*: the same two, each behind a relay thread, the relays joined by rings in place of
//!   the port (daemon mode's shape: four polling threads).
//!
//! The extra one-way time of the relay over the pair is what daemon mode adds at the very least;
//! a daemon row's floor is its direct row plus that. Threads of one process switch no slower than
//! a process and a daemon do, so the figure errs low.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use lanbus_ring::pipe::{PipeConfig, Receiver, Sender};
use lanbus_ring::{CopyMode, Region};

/// Bytes of the record passed around: a small message's record.
pub const RECORD: usize = 64;

/// How long a thread waits for a record before it gives up.
const GIVE_UP: Duration = Duration::from_secs(1);

const PIPE: PipeConfig = PipeConfig { slots: 64, buffers: 64, buf_size: 128 };

/// One ring from one thread to another.
fn pipes(n: usize) -> anyhow::Result<Vec<(Sender, Receiver)>> {
    let each = PIPE.bytes_needed().next_multiple_of(4096);
    let region = Arc::new(Region::anonymous(each * n).context("mapping the relay's rings")?);
    (0..n)
        .map(|k| {
            PIPE.format(&region, k * each)?;
            Ok((
                Sender::attach(region.clone(), k * each, CopyMode::Ordinary)?,
                Receiver::attach(region.clone(), k * each)?,
            ))
        })
        .collect::<Result<_, lanbus_ring::Error>>()
        .context("formatting the relay's rings")
}

/// Copies a received record (at most [`RECORD`] bytes of it) into `buf`.
fn keep(buf: &mut [u8; RECORD], record: &[u8]) {
    let n = record.len().min(RECORD);
    buf[..n].copy_from_slice(&record[..n]);
}

/// Takes one record from `rx` into `buf`, yielding the core after every empty look; false once
/// `stop` is set or a second passed.
fn take(rx: &mut Receiver, buf: &mut [u8; RECORD], stop: &AtomicBool) -> anyhow::Result<bool> {
    let start = Instant::now();
    for looks in 0u32.. {
        if rx.recv(|r| keep(buf, r))? {
            return Ok(true);
        }
        // Relaxed: only the flag itself is read.
        if stop.load(Ordering::Relaxed) || (looks % 1024 == 0 && start.elapsed() > GIVE_UP) {
            return Ok(false);
        }
        std::thread::yield_now();
    }
    Ok(false)
}

/// Puts `buf` in `tx`, yielding the core while the ring is full; an error after a second.
fn give(tx: &mut Sender, buf: &[u8]) -> anyhow::Result<()> {
    let start = Instant::now();
    while !tx.send(buf)? {
        if start.elapsed() > GIVE_UP {
            anyhow::bail!("a ring stayed full for {GIVE_UP:?}");
        }
        std::thread::yield_now();
    }
    Ok(())
}

/// Half the mean round trip (µs) of `rounds` records from a pinger to an echo, with a relay
/// thread in front of each when `relayed`.
fn one_way_us(relayed: bool, rounds: usize) -> anyhow::Result<f64> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    // The ends' rings: to and from the echo, and with relays the relays' four.
    let (ping_tx, ping_rx, echo_tx, echo_rx);
    if relayed {
        // 0: ping -> relay a, 1: relay a -> relay b, 2: relay b -> echo,
        // 3: echo -> relay b, 4: relay b -> relay a, 5: relay a -> ping.
        let mut p: Vec<Option<(Sender, Receiver)>> = pipes(6)?.into_iter().map(Some).collect();
        let mut take_pipe = |k: usize| p[k].take().expect("each ring taken once");
        let (t0, r0) = take_pipe(0);
        let (t1, r1) = take_pipe(1);
        let (t2, r2) = take_pipe(2);
        let (t3, r3) = take_pipe(3);
        let (t4, r4) = take_pipe(4);
        let (t5, r5) = take_pipe(5);
        (ping_tx, ping_rx, echo_tx, echo_rx) = (t0, r5, t3, r2);
        // Relay a forwards 0 -> 1 and 4 -> 5; relay b 1 -> 2 and 3 -> 4.
        for (mut in1, mut out1, mut in2, mut out2) in [(r0, t1, r4, t5), (r1, t2, r3, t4)] {
            let stop = stop.clone();
            threads.push(std::thread::spawn(move || -> anyhow::Result<()> {
                let mut buf = [0u8; RECORD];
                while !stop.load(Ordering::Relaxed) {
                    let mut moved = false;
                    for (rx, tx) in [(&mut in1, &mut out1), (&mut in2, &mut out2)] {
                        if rx.recv(|r| keep(&mut buf, r))? {
                            give(tx, &buf)?;
                            moved = true;
                        }
                    }
                    if !moved {
                        std::thread::yield_now();
                    }
                }
                Ok(())
            }));
        }
    } else {
        let mut p = pipes(2)?.into_iter();
        let ((t0, r0), (t1, r1)) = (p.next().expect("two rings"), p.next().expect("two rings"));
        (ping_tx, ping_rx, echo_tx, echo_rx) = (t0, r1, t1, r0);
    }
    let (mut echo_tx, mut echo_rx) = (echo_tx, echo_rx);
    let echo_stop = stop.clone();
    threads.push(std::thread::spawn(move || -> anyhow::Result<()> {
        let mut buf = [0u8; RECORD];
        // The echo waits for the next record as long as the pinger runs.
        while !echo_stop.load(Ordering::Relaxed) {
            if take(&mut echo_rx, &mut buf, &echo_stop)? {
                give(&mut echo_tx, &buf)?;
            }
        }
        Ok(())
    }));
    let (mut tx, mut rx) = (ping_tx, ping_rx);
    let mut measure = || -> anyhow::Result<f64> {
        let mut buf = [0u8; RECORD];
        let mut round = |i: usize| -> anyhow::Result<()> {
            buf[..8].copy_from_slice(&(i as u64).to_le_bytes());
            give(&mut tx, &buf)?;
            let mut back = [0u8; RECORD];
            if !take(&mut rx, &mut back, &AtomicBool::new(false))? || back[..8] != buf[..8] {
                anyhow::bail!("record {i} did not come back within {GIVE_UP:?}");
            }
            Ok(())
        };
        for i in 0..rounds / 10 {
            round(i)?;
        }
        let start = Instant::now();
        for i in 0..rounds {
            round(i)?;
        }
        Ok(start.elapsed().as_secs_f64() * 1e6 / rounds as f64 / 2.0)
    };
    let result = measure();
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().map_err(|_| anyhow::anyhow!("a relay thread panicked"))??;
    }
    result
}

/// The extra one-way time (µs) of daemon mode's shape over direct mode's: the relay's one-way
/// time less the pair's, each the best of three trials, the two measured in turns.
pub fn extra_one_way_us(quick: bool) -> anyhow::Result<f64> {
    let rounds = if quick { 5_000 } else { 50_000 };
    let (mut pair, mut relay) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..3 {
        pair = pair.min(one_way_us(false, rounds)?);
        relay = relay.min(one_way_us(true, rounds)?);
    }
    Ok((relay - pair).max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_come_back_through_the_pair_and_through_the_relays() {
        // `round` fails when a record does not come back as it went.
        assert!(one_way_us(false, 200).unwrap() > 0.0);
        assert!(one_way_us(true, 200).unwrap() > 0.0);
    }
}
