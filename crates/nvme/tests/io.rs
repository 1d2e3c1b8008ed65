//! Driver and controller joined in-process: init, identify, data round trips through every PRP
//! shape, flush, write zeroes, deallocate, a seeded random workload against a reference, several
//! queue pairs from threads, file backing that persists.

mod common;
use common::*;

use lanbus_bridge::dma::DmaMemory;
use lanbus_nvme::command::{nvm_opcode, Sqe};
use lanbus_nvme::local::{LocalNvme, ProcessMode};
use lanbus_nvme::status::Status;
use lanbus_nvme::{prp, CompletionMode, ControllerConfig, DriverConfig, FileBacking};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

const MODES: [(ProcessMode, CompletionMode); 3] = [
    (ProcessMode::Inline, CompletionMode::Interrupt),
    (ProcessMode::Thread, CompletionMode::Interrupt),
    (ProcessMode::Thread, CompletionMode::Poll),
];

fn dcfg(completion: CompletionMode) -> DriverConfig {
    DriverConfig { completion, ..DriverConfig::default() }
}

#[test]
fn init_and_identify() {
    for lba in [512u32, 4096] {
        for (mode, completion) in MODES {
            let (l, d) = pair(lba, 8 * MIB, mode, dcfg(completion));
            let id = d.identity();
            assert_eq!(id.lba_size, lba);
            assert_eq!(id.blocks, 8 * MIB / u64::from(lba));
            assert_eq!(id.nsid, 1);
            assert_eq!(id.serial, "LANBUS0001");
            assert_eq!(id.model, "lanbus NVMe model");
            assert_eq!(id.max_transfer_bytes, 1 << 20);
            assert!(id.volatile_write_cache);
            assert_eq!(id.oncs & 0b1100, 0b1100);
            assert_eq!(d.io_queue_count(), 4);
            assert_eq!(d.size_bytes(), 8 * MIB);
            drop(d);
            // Shutdown deleted the I/O queues and freed all DMA memory.
            assert_eq!(l.region().pages_in_use(), 0);
            let st = l.controller().stats();
            assert_eq!(st.error_completions, 0);
        }
    }
}

#[test]
fn reinit_after_driver_restart_keeps_data() {
    let l = local(512, 4 * MIB, ProcessMode::Inline);
    let data = pattern(1, 64 * 1024);
    {
        let d = l.driver(DriverConfig::default()).unwrap();
        d.write(100, &data, false).unwrap();
    }
    let d = l.driver(DriverConfig::default()).unwrap();
    let mut back = vec![0u8; data.len()];
    d.read(100, &mut back).unwrap();
    assert_eq!(back, data);
}

#[test]
fn round_trips_many_sizes() {
    for lba in [512usize, 4096] {
        for (mode, completion) in MODES {
            let (_l, d) = pair(lba as u32, 16 * MIB, mode, dcfg(completion));
            let blocks_max = (16 * MIB) as usize / lba;
            // 1 block, PRP2 sizes, lists, several MDTS chunks (1 MiB each) in flight together.
            for (i, &bytes) in [lba, 4096, 4096 + lba, 8192, 12288, 65536, 1 << 20, (1 << 20) + lba, 3 << 20]
                .iter()
                .enumerate()
            {
                let bytes = bytes.max(lba) / lba * lba;
                let start = (i * 977) % (blocks_max - bytes / lba);
                let data = pattern(i as u64 + lba as u64, bytes);
                d.write(start as u64, &data, i % 2 == 0).unwrap();
                let mut back = vec![0u8; bytes];
                d.read(start as u64, &mut back).unwrap();
                assert_eq!(back, data, "lba {lba} bytes {bytes} at {start} mode {mode:?}/{completion:?}");
            }
        }
    }
}

#[test]
fn byte_addressed_helpers() {
    let (_l, d) = pair(512, 4 * MIB, ProcessMode::Inline, DriverConfig::default());
    let mut model = vec![0u8; (4 * MIB) as usize];
    for (i, &(off, len)) in
        [(0u64, 1usize), (511, 2), (1000, 5000), (4095, 4097), (1 << 20, 300_000)].iter().enumerate()
    {
        let data = pattern(i as u64, len);
        d.write_at(off, &data, false).unwrap();
        model[off as usize..off as usize + len].copy_from_slice(&data);
        let mut back = vec![0u8; len + 700];
        let from = off.saturating_sub(300);
        d.read_at(from, &mut back).unwrap();
        assert_eq!(back, model[from as usize..from as usize + len + 700]);
    }
    d.write_zeroes_at(700, 3000, true).unwrap();
    model[700..3700].fill(0);
    d.trim_at(1 << 20, 4096).unwrap();
    model[1 << 20..(1 << 20) + 4096].fill(0);
    let mut all = vec![0u8; model.len()];
    d.read_at(0, &mut all).unwrap();
    assert!(all == model);
    assert!(d.read_at(4 * MIB - 1, &mut [0u8; 2]).is_err());
    assert!(d.write_at(u64::MAX, &[0u8; 2], false).is_err());
}

/// PRP shapes the driver's own buffers never produce: PRP1 offsets, and chained lists (more than
/// 512 entries, with MDTS raised to 4 MiB).
#[test]
fn prp_offsets_and_chained_lists() {
    let cfg = ControllerConfig { mdts: 10, ..ControllerConfig::default() };
    let l = LocalNvme::new(controller(512, 16 * MIB, cfg), 8192, ProcessMode::Inline);
    let d = l.driver(DriverConfig::default()).unwrap();
    let mem = d.dma().clone();
    let mut n = 0;
    for &offset in &[0usize, 4, 512, 2048, 4092] {
        for &bytes in &[512usize, 3584, 4096, 4608, 8192, 12800, 1 << 20, (2 << 20) + 4096, 4 << 20] {
            n += 1;
            let lba = (n * 131) as u64;
            let data = pattern(n as u64, bytes);
            let out = raw_io(&*mem, &d, nvm_opcode::WRITE, lba, offset, bytes, Some(&data));
            assert_eq!(out, data);
            let back = raw_io(&*mem, &d, nvm_opcode::READ, lba, offset, bytes, None);
            assert!(back == data, "offset {offset} bytes {bytes}");
            let mut via_driver = vec![0u8; bytes];
            d.read(lba, &mut via_driver).unwrap();
            assert_eq!(via_driver, data);
        }
    }
    /// One Read or Write of `len` bytes whose buffer starts `offset` bytes into a fresh page.
    #[allow(clippy::too_many_arguments)]
    fn raw_io(
        mem: &dyn DmaMemory,
        d: &lanbus_nvme::NvmeDriver,
        op: u8,
        lba: u64,
        offset: usize,
        len: usize,
        data: Option<&[u8]>,
    ) -> Vec<u8> {
        let page = 4096;
        let pages = (offset + len).div_ceil(page);
        let buf = mem.alloc(pages).unwrap();
        let addr = buf + offset as u64;
        let lists = prp::list_pages_needed(addr, len, page);
        let list_pages: Vec<u64> = (0..lists).map(|_| mem.alloc(1).unwrap()).collect();
        let plan = prp::build(addr, len, page, &list_pages);
        for (a, bytes) in &plan.lists {
            mem.write(*a, bytes).unwrap();
        }
        if let Some(data) = data {
            mem.write(addr, data).unwrap();
        }
        let sqe = Sqe {
            opcode: op,
            nsid: 1,
            prp1: plan.prp1,
            prp2: plan.prp2,
            cdw: [lba as u32, 0, (len / 512) as u32 - 1, 0, 0, 0],
            ..Sqe::default()
        };
        let c = d.submit_io_raw(0, sqe).unwrap();
        assert!(c.status.is_success(), "{}", c.status);
        let mut out = vec![0u8; len];
        mem.read(addr, &mut out).unwrap();
        mem.free(buf, pages);
        for p in list_pages {
            mem.free(p, 1);
        }
        out
    }
}

#[test]
fn flush_write_zeroes_deallocate() {
    for lba in [512u32, 4096] {
        // 40 MiB: at 512-byte blocks more than 65536 blocks, so Write Zeroes over all of it
        // takes several commands.
        let (l, d) = pair(lba, 40 * MIB, ProcessMode::Thread, DriverConfig::default());
        let bs = lba as usize;
        let data = pattern(7, 256 * bs);
        d.write(0, &data, false).unwrap();
        d.flush().unwrap();
        d.write_zeroes(10, 20, false).unwrap();
        d.deallocate(100, 50).unwrap();
        d.write_zeroes(0, 0, false).unwrap();
        let mut back = vec![0u8; 256 * bs];
        d.read(0, &mut back).unwrap();
        let mut want = data.clone();
        want[10 * bs..30 * bs].fill(0);
        want[100 * bs..150 * bs].fill(0);
        assert!(back == want);
        let total = d.identity().blocks;
        d.write(total - 1, &data[..bs], true).unwrap();
        d.write_zeroes(0, total, true).unwrap();
        let mut last = vec![1u8; bs];
        d.read(total - 1, &mut last).unwrap();
        assert!(last.iter().all(|&b| b == 0));
        assert_eq!(l.controller().stats().error_completions, 0);
    }
}

#[test]
fn seeded_random_workload_matches_reference() {
    for (seed, (mode, completion)) in MODES.iter().enumerate() {
        let size = 4 * MIB as usize;
        let (_l, d) = pair(512, size as u64, *mode, dcfg(*completion));
        let mut rng = ChaCha8Rng::seed_from_u64(seed as u64 + 42);
        let mut model = vec![0u8; size];
        for step in 0..300 {
            let off = rng.random_range(0..size as u64 - 1);
            let len = rng.random_range(1..(size as u64 - off).min(300_000)) as usize;
            match rng.random_range(0..10) {
                0..=3 => {
                    let data = pattern(step, len);
                    d.write_at(off, &data, rng.random_bool(0.1)).unwrap();
                    model[off as usize..off as usize + len].copy_from_slice(&data);
                }
                4..=7 => {
                    let mut buf = vec![0u8; len];
                    d.read_at(off, &mut buf).unwrap();
                    assert!(buf == model[off as usize..off as usize + len], "step {step} seed {seed}");
                }
                8 => {
                    d.write_zeroes_at(off, len as u64, rng.random_bool(0.5)).unwrap();
                    model[off as usize..off as usize + len].fill(0);
                }
                _ => {
                    // Trim: whole blocks inside the range read back as zeroes.
                    d.trim_at(off, len as u64).unwrap();
                    let a = off.div_ceil(512) as usize * 512;
                    let b = (off as usize + len) / 512 * 512;
                    if a < b {
                        model[a..b].fill(0);
                    }
                }
            }
        }
        let mut all = vec![0u8; size];
        d.read(0, &mut all).unwrap();
        assert!(all == model);
    }
}

#[test]
fn queue_pairs_from_threads() {
    // Own vectors per queue, then all I/O queues sharing vector 1, then everything on vector 0.
    let vectors = [(17u16, MODES[0]), (17, MODES[1]), (17, MODES[2]), (2, MODES[1]), (1, MODES[0])];
    for (msix_vectors, (mode, completion)) in vectors {
        let cfg = DriverConfig { io_queues: 4, completion, msix_vectors, ..DriverConfig::default() };
        let (l, d) = pair(4096, 16 * MIB, mode, cfg);
        let d = Arc::new(d);
        let threads: Vec<_> = (0..6u64)
            .map(|t| {
                let d = d.clone();
                std::thread::spawn(move || {
                    // Each thread owns a 2 MiB slice of the namespace.
                    let base = t * 512;
                    let mut rng = ChaCha8Rng::seed_from_u64(t);
                    let mut model = vec![0u8; 2 << 20];
                    for i in 0..60 {
                        let blocks = rng.random_range(1..=64usize);
                        let start = rng.random_range(0..=512 - blocks);
                        if rng.random_bool(0.5) {
                            let data = pattern(t * 1000 + i, blocks * 4096);
                            d.write(base + start as u64, &data, false).unwrap();
                            model[start * 4096..(start + blocks) * 4096].copy_from_slice(&data);
                        } else {
                            let mut buf = vec![0u8; blocks * 4096];
                            d.read(base + start as u64, &mut buf).unwrap();
                            assert!(buf == model[start * 4096..(start + blocks) * 4096]);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(l.controller().stats().error_completions, 0);
    }
}

#[test]
fn file_backing_persists_after_drop_and_reopen() {
    let dir = std::env::temp_dir().join(format!("lanbus-nvme-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("disk.img");
    let _ = std::fs::remove_file(&path);
    let data = pattern(99, 300 * 1024);
    {
        let ctrl = lanbus_nvme::Controller::new(
            ControllerConfig { lba_size: 4096, ..ControllerConfig::default() },
            Box::new(FileBacking::open(&path, 8 * MIB).unwrap()),
        )
        .unwrap();
        let l = LocalNvme::new(ctrl, 4096, ProcessMode::Thread);
        let d = l.driver(DriverConfig::default()).unwrap();
        d.write_at(12345 * 4, &data, false).unwrap();
        d.flush().unwrap();
    }
    {
        let ctrl = lanbus_nvme::Controller::new(
            ControllerConfig { lba_size: 512, ..ControllerConfig::default() },
            Box::new(FileBacking::open_existing(&path).unwrap()),
        )
        .unwrap();
        let l = LocalNvme::new(ctrl, 4096, ProcessMode::Inline);
        let d = l.driver(DriverConfig::default()).unwrap();
        assert_eq!(d.size_bytes(), 8 * MIB);
        let mut back = vec![0u8; data.len()];
        d.read_at(12345 * 4, &mut back).unwrap();
        assert!(back == data);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn large_requests_go_in_windows_and_small_mdts_chunks() {
    // (1, 4 MiB): 512 commands per window, more than a queue of 256 holds at once.
    for (mdts, inflight) in [(8u8, 1usize << 20), (1, 64 << 10), (3, 1), (1, 4 << 20)] {
        let cfg = ControllerConfig { mdts, ..ControllerConfig::default() };
        let l = LocalNvme::new(controller(512, 16 * MIB, cfg), 4096, ProcessMode::Thread);
        let d = l.driver(DriverConfig { max_inflight_bytes: inflight, ..DriverConfig::default() }).unwrap();
        assert_eq!(d.identity().max_transfer_bytes, 4096 << mdts);
        let data = pattern(u64::from(mdts), (5 << 20) + 512);
        d.write(3, &data, false).unwrap();
        let mut back = vec![0u8; data.len()];
        d.read(3, &mut back).unwrap();
        assert!(back == data, "mdts {mdts} inflight {inflight}");
        drop(d);
        assert_eq!(l.region().pages_in_use(), 0, "every DMA buffer freed");
    }
}

#[test]
fn sgls_and_prps_move_the_same_bytes_and_bad_sgls_fail_cleanly() {
    for use_sgl in [true, false] {
        let (l, d) =
            pair(512, 8 * MIB, ProcessMode::Thread, DriverConfig { use_sgl, ..DriverConfig::default() });
        assert!(d.identity().sgl, "the controller takes SGLs");
        for (i, &len) in [512usize, 8192, 12288, 65536, 1 << 20].iter().enumerate() {
            let data = pattern(i as u64 + 40, len);
            let lba = (i * 2048) as u64;
            d.write(lba, &data, false).unwrap();
            let mut back = vec![0u8; len];
            d.read(lba, &mut back).unwrap();
            assert!(back == data, "sgl {use_sgl}, {len} bytes");
        }
        assert_eq!(l.controller().stats().error_completions, 0);
    }
    // Hand-made SGLs: a Last Segment of three scattered blocks, then malformed ones.
    let (l, d) = pair(512, 8 * MIB, ProcessMode::Inline, DriverConfig::default());
    let mem = d.dma().clone();
    let blocks: Vec<(u64, usize)> = [(2usize, 4096usize), (1, 1024), (1, 3072)]
        .iter()
        .map(|&(pages, len)| (mem.alloc(pages).unwrap() + 64, len))
        .collect();
    let total: usize = blocks.iter().map(|b| b.1).sum();
    let seg = mem.alloc(1).unwrap();
    let mut list = Vec::new();
    for &(addr, len) in &blocks {
        list.extend_from_slice(&addr.to_le_bytes());
        list.extend_from_slice(&(len as u32).to_le_bytes());
        list.extend_from_slice(&[0, 0, 0, 0x00]);
    }
    mem.write(seg, &list).unwrap();
    let data = pattern(99, total);
    let mut at = 0;
    for &(addr, len) in &blocks {
        mem.write(addr, &data[at..at + len]).unwrap();
        at += len;
    }
    let last_segment =
        |bytes: u32| sqe_sgl(nvm_opcode::WRITE, 300, total, seg, u64::from(bytes) | 0x30 << 56);
    let c = d.submit_io_raw(0, last_segment(48)).unwrap();
    assert!(c.status.is_success(), "{}", c.status);
    let mut back = vec![0u8; total];
    d.read(300, &mut back).unwrap();
    assert!(back == data, "the blocks were written in their order");
    // The blocks do not add up to the transfer; a segment of half a descriptor; a Bit Bucket.
    let c = d.submit_io_raw(0, sqe_sgl(nvm_opcode::READ, 300, total + 512, seg, 48 | 0x30 << 56)).unwrap();
    assert_eq!(c.status, Status::DATA_SGL_LENGTH_INVALID);
    let c = d.submit_io_raw(0, last_segment(40)).unwrap();
    assert_eq!(c.status, Status::INVALID_SGL_SEGMENT_DESCRIPTOR);
    let c = d.submit_io_raw(0, sqe_sgl(nvm_opcode::READ, 300, 512, seg, 512 | 0x10 << 56)).unwrap();
    assert_eq!(c.status, Status::SGL_DESCRIPTOR_TYPE_INVALID);
    // The controller goes on.
    d.read(300, &mut back).unwrap();
    assert!(back == data);
    assert_eq!(l.controller().stats().error_completions, 3);

    fn sqe_sgl(op: u8, lba: u64, len: usize, prp1: u64, prp2: u64) -> Sqe {
        Sqe {
            opcode: op,
            nsid: 1,
            psdt: 1,
            prp1,
            prp2,
            cdw: [lba as u32, 0, (len / 512) as u32 - 1, 0, 0, 0],
            ..Sqe::default()
        }
    }
}

#[test]
fn lent_reads_hand_over_the_dma_buffers_as_they_lie() {
    // MDTS 32 KiB: a 1 MiB read is 32 commands, lent as one reply of their buffers' pages.
    let cfg = ControllerConfig { mdts: 3, ..ControllerConfig::default() };
    let l = LocalNvme::new(controller(512, 8 * MIB, cfg), 4096, ProcessMode::Thread);
    let d = l.driver(DriverConfig { max_inflight_bytes: 1 << 20, ..DriverConfig::default() }).unwrap();
    let data = pattern(7, 2 << 20);
    d.write(0, &data, false).unwrap();
    for (off, len) in [(0u64, 512usize), (512, 4096), (4096, 33 << 10), (1536, 1 << 20)] {
        let mut got = Vec::new();
        let mut calls = 0;
        let r = d.read_lent(off, len, &mut |slices| {
            calls += 1;
            slices.iter().for_each(|s| got.extend_from_slice(s));
        });
        assert!(matches!(r, Some(Ok(()))), "{off}+{len}: {r:?}");
        assert_eq!(calls, 1);
        assert!(got == data[off as usize..off as usize + len], "{off}+{len}");
    }
    // Not lent: misaligned, empty, or more than one window; out of range is an error, unreplied.
    let mut never = |_: &[&[u8]]| panic!("replied");
    assert!(d.read_lent(100, 512, &mut never).is_none());
    assert!(d.read_lent(0, 0, &mut never).is_none());
    assert!(d.read_lent(0, (1 << 20) + 512, &mut never).is_none());
    assert!(matches!(d.read_lent(8 * MIB - 512, 1024, &mut never), Some(Err(_))));
    drop(d);
    assert_eq!(l.region().pages_in_use(), 0, "every DMA buffer freed");
}

#[test]
fn thread_safety_of_the_public_types() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<lanbus_nvme::Controller>();
    send_sync::<lanbus_nvme::NvmeDriver>();
    send_sync::<lanbus_bridge::dma::HostRegion>();
    send_sync::<lanbus_nvme::local::LocalNvme>();
}
