//! A frontend's side of the rings for the backend tests: guest memory in a shared file and split
//! virtqueues laid out in it, written the way a guest's driver writes them.

#![allow(dead_code)]

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Entries per queue.
pub const QUEUE: u16 = 16;
pub const VIRTQ_DESC_F_NEXT: u16 = 1;
pub const VIRTQ_DESC_F_WRITE: u16 = 2;

/// Guest memory backed by a file the backend maps.
pub struct SharedMem {
    pub mem: GuestMemoryMmap,
    file: std::fs::File,
    path: PathBuf,
}

impl SharedMem {
    pub fn new(name: &str, bytes: usize) -> SharedMem {
        let path = std::env::temp_dir().join(format!("lanbus-vhost-{name}-{}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len(bytes as u64).unwrap();
        let mem = GuestMemoryMmap::<()>::from_ranges_with_files([(
            GuestAddress(0),
            bytes,
            Some(FileOffset::new(file.try_clone().unwrap(), 0)),
        )])
        .unwrap();
        SharedMem { mem, file, path }
    }

    /// The backend's address of guest address `gpa` (the frontend's own mapping).
    pub fn va(&self, gpa: u64) -> u64 {
        self.mem.get_host_address(GuestAddress(gpa)).unwrap() as u64
    }

    /// Tells the backend about the memory.
    pub fn share(&self, f: &mut Frontend) {
        f.set_mem_table(&[VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: self.mem.iter().map(|r| r.len()).sum(),
            userspace_addr: self.va(0),
            mmap_offset: 0,
            mmap_handle: self.file.as_raw_fd(),
        }])
        .unwrap();
    }
}

impl Drop for SharedMem {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One split virtqueue of [`QUEUE`] entries at `base`: descriptors, then the available ring a
/// page on, the used ring two pages on.
pub struct Ring {
    pub mem: GuestMemoryMmap,
    pub base: u64,
    pub avail_idx: u16,
    next_desc: u16,
    pub seen: u16,
    pub kick: EventFd,
    pub call: EventFd,
}

impl Ring {
    /// Sets up queue `index` at `base` and, with protocol features negotiated (`enable`), enables
    /// it (without them a ring is enabled once it has its kick).
    pub fn setup(f: &mut Frontend, shared: &SharedMem, index: usize, base: u64, enable: bool) -> Ring {
        let (kick, call) = (EventFd::new(EFD_NONBLOCK).unwrap(), EventFd::new(EFD_NONBLOCK).unwrap());
        f.set_vring_num(index, QUEUE).unwrap();
        f.set_vring_addr(
            index,
            &VringConfigData {
                queue_max_size: QUEUE,
                queue_size: QUEUE,
                flags: 0,
                desc_table_addr: shared.va(base),
                used_ring_addr: shared.va(base + 0x2000),
                avail_ring_addr: shared.va(base + 0x1000),
                log_addr: None,
            },
        )
        .unwrap();
        f.set_vring_base(index, 0).unwrap();
        f.set_vring_call(index, &call).unwrap();
        f.set_vring_kick(index, &kick).unwrap();
        if enable {
            f.set_vring_enable(index, true).unwrap();
        }
        Ring { mem: shared.mem.clone(), base, avail_idx: 0, next_desc: 0, seen: 0, kick, call }
    }

    pub fn avail(&self) -> u64 {
        self.base + 0x1000
    }

    fn used(&self) -> u64 {
        self.base + 0x2000
    }

    pub fn desc(&mut self, addr: u64, len: u32, flags: u16, next: u16) -> u16 {
        let i = self.next_desc;
        self.next_desc = (self.next_desc + 1) % QUEUE;
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        self.mem.write_slice(&d, GuestAddress(self.base + 16 * u64::from(i))).unwrap();
        i
    }

    /// A chain of (address, length, device-writable) buffers; returns its head.
    pub fn chain(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        let first = self.next_desc;
        for (k, &(addr, len, write)) in bufs.iter().enumerate() {
            let last = k + 1 == bufs.len();
            let flags = if write { VIRTQ_DESC_F_WRITE } else { 0 } | if last { 0 } else { VIRTQ_DESC_F_NEXT };
            let next = (self.next_desc + 1) % QUEUE;
            self.desc(addr, len, flags, if last { 0 } else { next });
        }
        first
    }

    /// Makes `head` available and kicks.
    pub fn publish(&mut self, head: u16) {
        let slot = self.avail() + 4 + 2 * u64::from(self.avail_idx % QUEUE);
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem.write_obj(self.avail_idx, GuestAddress(self.avail() + 2)).unwrap();
        self.kick.write(1).unwrap();
    }

    pub fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(self.used() + 2)).unwrap()
    }

    /// Waits for the next used entry: (head, length).
    pub fn next_used(&mut self) -> (u32, u32) {
        let n = self.seen;
        self.seen = self.seen.wrapping_add(1);
        let t = Instant::now();
        while self.used_idx() <= n {
            assert!(t.elapsed() < Duration::from_secs(5), "buffer {n} not used");
            std::thread::sleep(Duration::from_millis(5));
        }
        let at = self.used() + 4 + 8 * u64::from(n % QUEUE);
        (self.mem.read_obj(GuestAddress(at)).unwrap(), self.mem.read_obj(GuestAddress(at + 4)).unwrap())
    }
}
