//! A seeded data pattern for a block device, built as a static binary for the test guest (no
//! dependencies: `rustc -O -C target-feature=+crt-static pattern.rs`).
//!
//!   pattern write SEED MIB DEVICE    writes MIB MiB of the pattern from offset 0, fsyncs
//!   pattern read SEED MIB DEVICE     reads them back and compares with the pattern
//!   pattern zero AT LEN DEVICE       zeroes LEN MiB from AT MiB (BLKZEROOUT, the kernel's
//!                                    write-zeroes) and checks they read back as zero
//!
//! Both print `checksum=<16 hex digits>` of the bytes written or read (a 64-bit multiply-xor
//! hash over little-endian words), `mismatches=N` (MiB chunks that differ, for read) and
//! `bytes=N`; the exit status is 0 only if every chunk matched.

use std::io::{Read, Write};

const CHUNK: usize = 1 << 20;

/// xorshift64*: the pattern's generator, one per chunk so chunks can be made independently.
fn fill(seed: u64, chunk: u64, buf: &mut [u8]) {
    let mut x = (seed ^ chunk.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1;
    for w in buf.chunks_exact_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        w.copy_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
}

fn hash(mut h: u64, buf: &[u8]) -> u64 {
    for w in buf.chunks_exact(8) {
        let v = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        h = (h ^ v).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(23);
    }
    h
}

extern "C" {
    fn ioctl(fd: i32, request: u64, ...) -> i32;
}

/// `_IO(0x12, 127)`: zero a byte range of a block device (`uint64_t range[2]`: start, length).
const BLKZEROOUT: u64 = 0x127f;

fn zero(at_mib: u64, len_mib: u64, path: &str) -> u64 {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).expect("open for zeroing");
    let range = [at_mib * CHUNK as u64, len_mib * CHUNK as u64];
    // SAFETY: BLKZEROOUT reads two u64s from the pointer, which points at `range`.
    let r = unsafe { ioctl(f.as_raw_fd(), BLKZEROOUT, range.as_ptr()) };
    if r != 0 {
        eprintln!("BLKZEROOUT: {}", std::io::Error::last_os_error());
        std::process::exit(1);
    }
    let mut got = vec![0u8; CHUNK];
    let mut f = std::fs::File::open(path).expect("open for reading");
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(range[0])).expect("seek");
    let mut nonzero = 0;
    for _ in 0..len_mib {
        f.read_exact(&mut got).expect("read");
        nonzero += u64::from(got.iter().any(|&b| b != 0));
    }
    nonzero
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        eprintln!("usage: pattern write|read SEED MIB DEVICE, or pattern zero AT LEN DEVICE");
        std::process::exit(2);
    }
    let seed: u64 = args[2].parse().expect("SEED is a number");
    let mib: u64 = args[3].parse().expect("MIB is a number");
    let path = &args[4];
    let mut want = vec![0u8; CHUNK];
    let mut got = vec![0u8; CHUNK];
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut mismatches = 0u64;
    match args[1].as_str() {
        "write" => {
            let mut f = std::fs::OpenOptions::new().write(true).open(path).expect("open for writing");
            for c in 0..mib {
                fill(seed, c, &mut want);
                f.write_all(&want).expect("write");
                h = hash(h, &want);
            }
            f.sync_all().expect("fsync");
        }
        "zero" => {
            let nonzero = zero(seed, mib, path);
            println!("zeroed={mib} nonzero={nonzero}");
            std::process::exit(if nonzero == 0 { 0 } else { 1 });
        }
        "read" => {
            let mut f = std::fs::File::open(path).expect("open for reading");
            for c in 0..mib {
                fill(seed, c, &mut want);
                f.read_exact(&mut got).expect("read");
                h = hash(h, &got);
                if got != want {
                    mismatches += 1;
                }
            }
        }
        other => {
            eprintln!("pattern: unknown mode {other}");
            std::process::exit(2);
        }
    }
    println!("checksum={h:016x} mismatches={mismatches} bytes={}", mib * CHUNK as u64);
    std::process::exit(if mismatches == 0 { 0 } else { 1 });
}
