//! Two processes exchange Ethernet frames through an `shm:` port. The child is this test binary
//! re-executed with `LANBUS_SHM_CHILD=<spec>`, running only `child_entry` (a no-op otherwise).

use std::process::Command;
use std::time::{Duration, Instant};

use lanbus_port::shm::ShmPort;
use lanbus_port::Port;

const FRAMES: usize = 3000;

fn frame(i: usize) -> Vec<u8> {
    let len = 60 + (i * 131) % 1455;
    let mut f: Vec<u8> = (0..len).map(|b| (b as u8).wrapping_add(i as u8)).collect();
    f[..4].copy_from_slice(&(i as u32).to_be_bytes());
    f
}

#[test]
fn frames_cross_two_processes() {
    let path = std::env::temp_dir().join(format!("lanbus-shm-test-{}.sock", std::process::id()));
    let spec = format!("shm:{}", path.display());
    let mut port = ShmPort::open(&spec).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("LANBUS_SHM_CHILD", &spec)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut sent, mut got) = (0usize, 0usize);
    while got < FRAMES {
        assert!(Instant::now() < deadline, "timed out: sent {sent}, echoed {got}");
        let mut next = sent;
        let n = port
            .tx_burst(32, &mut |buf| {
                if next >= FRAMES {
                    return None;
                }
                let f = frame(next);
                next += 1;
                buf[..f.len()].copy_from_slice(&f);
                Some(f.len())
            })
            .unwrap();
        // The shm port calls fill only when it has a free buffer, so every frame filled is sent.
        assert_eq!(next, sent + n);
        sent += n;
        let received = port
            .rx_burst(32, &mut |f| {
                let mut want = frame(got);
                want.reverse();
                assert_eq!(f, &want[..], "echo of frame {got}");
                got += 1;
            })
            .unwrap();
        if received == 0 && sent == FRAMES {
            port.wait(Some(Duration::from_millis(100))).unwrap();
        }
    }
    assert!(child.wait().unwrap().success());
    let c = port.counters();
    assert_eq!((c.tx_frames, c.rx_frames, c.rx_dropped), (FRAMES as u64, FRAMES as u64, 0));
}

#[test]
fn child_entry() {
    let Ok(spec) = std::env::var("LANBUS_SHM_CHILD") else { return };
    let mut port = ShmPort::open(&spec).unwrap();
    let mut echoed = 0;
    let mut backlog: std::collections::VecDeque<Vec<u8>> = Default::default();
    let deadline = Instant::now() + Duration::from_secs(60);
    while echoed < FRAMES {
        assert!(Instant::now() < deadline, "child timed out after {echoed}");
        port.rx_burst(32, &mut |f| {
            let mut v = f.to_vec();
            v.reverse();
            backlog.push_back(v);
        })
        .unwrap();
        let n = port
            .tx_burst(32, &mut |buf| {
                let f = backlog.pop_front()?;
                buf[..f.len()].copy_from_slice(&f);
                Some(f.len())
            })
            .unwrap();
        echoed += n;
        if backlog.is_empty() && n == 0 {
            port.wait(Some(Duration::from_millis(100))).unwrap();
        }
    }
}
