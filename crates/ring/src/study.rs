//! The vhost-user cache-efficiency study, as a runnable model (`lanbus bench vring`).
//!
//! Layer: rings (measurement code; not used by the data plane). An **Rx thread** (the vhost
//! back-end) takes free guest buffers from a packed virtqueue, copies 64 B packets into them from
//! a host packet pool and marks them used; a **guest thread** (the virtio-net driver) takes used
//! buffers, reads each packet and gives a fresh buffer back. Both run in bursts of 32. Five
//! factors, each switchable ([`Factors`]):
//!
//! - (a) `last_avail_idx` (written by Rx per packet) and `last_used_idx` (written by the guest per
//!   packet) each on its own cache line with a guard line, away from the descriptors. Off: packed
//!   together at the head of the queue struct, sharing a line with the first descriptors (as in
//!   the paper's base: `struct vq { int32 last_avail_idx, last_used_idx; desc descs[256]; }`).
//! - (b) the Rx copy uses non-temporal stores (one `sfence` per burst, before publishing).
//! - (c) 8 B descriptors (buffer index u32, len u16, flags u16) instead of 16 B (address u64,
//!   len u32, id u16, flags u16).
//! - (d) no 128 B per-packet header (the `rte_mbuf`): off, the guest writes 128 B of metadata at
//!   the head of every buffer it receives, and packet data starts at +128.
//! - (e) 64 B of packet space per buffer instead of 2048 B.
//!
//! Buffer size = header (128 or 0) + data (2048 or 64): base 2176 B, (e) 192 B, (d) 2048 B,
//! (d)+(e) 64 B. With [`StudyConfig::spread`] each buffer is padded to an odd number of cache
//! lines, as DPDK's mempool pads its objects (base 2240 B, (d) 2112 B), so that the packets in
//! flight spread over all cache sets instead of (d)'s power-of-two stride putting them in two
//! sets of the L1; on the machine measured so far that raises no figure, so the default is the
//! paper's unpadded layout. The guest allocates buffers round-robin from a pool of
//! [`StudyConfig::pool_buffers`] (a DPDK mempool), the Rx thread copies from [`SOURCE_PACKETS`]
//! host packets of the same layout. Every packet carries its sequence number, which the guest
//! checks, so a broken protocol fails the run instead of producing a number.
//!
//! What the factors are worth depends on the machine more than on the model: a cache line
//! crossing between the two cores (what (a) and (d) save) costs the round trip that
//! [`line_round_trip_ns`] measures, which on a VM depends on where the host runs the two vCPUs;
//! a non-temporal store (b) sends the packet to memory, from where the guest, which reads it right
//! after, must fetch it again, which only pays where that costs less than a line crossing between
//! the cores.
//!
//! Invariants of the queue protocol are those of [`crate::virtqueue`] (avail/used flags with wrap
//! counters, Release on the flags store, Acquire on the flags load); the model re-implements it on
//! raw memory because the layouts under study are not the ones the real queue uses.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::copy::{copy_bytes, store_fence, CopyMode};
use crate::{Region, Result};

/// Host packets the Rx thread copies from, cycled.
pub const SOURCE_PACKETS: usize = 512;
/// Bytes per packet.
pub const PACKET_BYTES: usize = 64;
/// Packets per burst on both threads.
pub const BURST: usize = 32;

const F_AVAIL: u16 = 1 << 7;
const F_USED: u16 = 1 << 15;

/// Which of the paper's factors are on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Factors {
    /// Shared variables on separate cache lines.
    pub a: bool,
    /// Non-temporal copy.
    pub b: bool,
    /// 8 B descriptors.
    pub c: bool,
    /// No per-packet 128 B header.
    pub d: bool,
    /// 64 B packet buffers.
    pub e: bool,
}

impl Factors {
    /// Parses a row name: `base`, `all`, letters joined by `+` (`a+d`), or `all-` followed by the
    /// letters to leave out (`all-b`: every factor but (b)).
    pub fn parse(name: &str) -> Option<Factors> {
        let all = Factors { a: true, b: true, c: true, d: true, e: true };
        match name {
            "base" => return Some(Factors::default()),
            "all" => return Some(all),
            _ => {}
        }
        let (mut f, on, letters) = match name.strip_prefix("all-") {
            Some(rest) => (all, false, rest),
            None => (Factors::default(), true, name),
        };
        for part in letters.split('+') {
            match part {
                "a" => f.a = on,
                "b" => f.b = on,
                "c" => f.c = on,
                "d" => f.d = on,
                "e" => f.e = on,
                _ => return None,
            }
        }
        Some(f)
    }

    /// Every combination of the five factors, `base` first and `all` last, each with its name
    /// (`base`, `a`, `a+b`, ..., `all`).
    pub fn every() -> Vec<(String, Factors)> {
        let mut out: Vec<(String, Factors)> = (0..32u8)
            .map(|bits| {
                let f = Factors {
                    a: bits & 1 != 0,
                    b: bits & 2 != 0,
                    c: bits & 4 != 0,
                    d: bits & 8 != 0,
                    e: bits & 16 != 0,
                };
                (f.name(), f)
            })
            .collect();
        out.sort_by_key(|(_, f)| f.count());
        out
    }

    /// How many factors are on.
    pub fn count(&self) -> usize {
        [self.a, self.b, self.c, self.d, self.e].iter().filter(|&&x| x).count()
    }

    /// The canonical name: `base`, `all`, or the letters joined by `+`.
    pub fn name(&self) -> String {
        match self.count() {
            0 => "base".to_string(),
            5 => "all".to_string(),
            _ => [(self.a, "a"), (self.b, "b"), (self.c, "c"), (self.d, "d"), (self.e, "e")]
                .iter()
                .filter(|(on, _)| *on)
                .map(|(_, l)| *l)
                .collect::<Vec<_>>()
                .join("+"),
        }
    }

    fn header_bytes(&self) -> usize {
        if self.d {
            0
        } else {
            128
        }
    }

    /// Bytes per buffer (header + packet space), before any padding ([`StudyConfig::stride`]).
    pub fn stride(&self) -> usize {
        self.header_bytes() + if self.e { PACKET_BYTES } else { 2048 }
    }

    fn desc_bytes(&self) -> usize {
        if self.c {
            8
        } else {
            16
        }
    }
}

/// One run's parameters.
#[derive(Debug, Clone, Copy)]
pub struct StudyConfig {
    /// The factors.
    pub factors: Factors,
    /// Packets to move (at most, with [`StudyConfig::duration`]).
    pub packets: u64,
    /// Stops the run after about this long (the Rx thread looks at the clock every 64 bursts);
    /// `None` moves exactly `packets`.
    pub duration: Option<Duration>,
    /// Descriptors in the virtqueue (a power of two).
    pub queue_size: usize,
    /// Guest buffers, allocated round-robin (at least twice the queue size).
    pub pool_buffers: usize,
    /// CPUs to pin the Rx and guest threads to; `None` runs unpinned.
    pub cpus: Option<(usize, usize)>,
    /// Pads every buffer to an odd number of cache lines, as DPDK's mempool pads its objects, so
    /// that consecutive buffers spread over all cache sets. Off (the paper's layout), a buffer
    /// whose size is a power of two ((d) alone: 2048 B) puts the packets in flight in two sets of
    /// a 64-set L1; `lanbus bench vring --stride odd,natural` compares the two.
    pub spread: bool,
}

impl StudyConfig {
    /// The defaults used by `lanbus bench vring`: 256 descriptors, 8192 guest buffers, unpadded.
    pub fn new(factors: Factors, packets: u64) -> Self {
        StudyConfig {
            factors,
            packets,
            duration: None,
            queue_size: 256,
            pool_buffers: 8192,
            cpus: None,
            spread: false,
        }
    }

    /// Bytes from one buffer to the next: [`Factors::stride`], plus one cache line where
    /// [`StudyConfig::spread`] asks for an odd number of lines.
    pub fn stride(&self) -> usize {
        let s = self.factors.stride();
        if self.spread && (s / 64).is_multiple_of(2) {
            s + 64
        } else {
            s
        }
    }

    /// Bytes of the guest pool.
    pub fn pool_bytes(&self) -> usize {
        self.pool_buffers * self.stride()
    }
}

/// What a run measured.
#[derive(Debug, Clone, Copy)]
pub struct StudyResult {
    /// Packets moved.
    pub packets: u64,
    /// Wall time from both threads ready to the guest's last packet.
    pub elapsed: Duration,
    /// Whether both threads were pinned as asked.
    pub pinned: bool,
    /// The lower of the two threads' CPU time over its wall time while it ran: near 1 when each
    /// had a CPU to itself, lower when other work (or the other thread, on one CPU) took turns.
    pub cpu_share: f64,
}

impl StudyResult {
    /// Millions of packets per second.
    pub fn mpps(&self) -> f64 {
        self.packets as f64 / self.elapsed.as_secs_f64() / 1e6
    }
}

/// The CPUs this process may run on (sched_getaffinity).
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it; the result is checked.
    unsafe {
        let mut set: libc::cpu_set_t = core::mem::zeroed();
        if libc::sched_getaffinity(0, core::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
    }
}

/// Pins the calling thread to `cpu`; returns whether it worked.
pub fn pin_current_thread(cpu: usize) -> bool {
    set_current_thread_cpus(&[cpu])
}

/// Lets the calling thread run on exactly `cpus` (e.g. back to what [`allowed_cpus`] returned
/// before pinning); returns whether it worked.
pub fn set_current_thread_cpus(cpus: &[usize]) -> bool {
    if cpus.is_empty() || cpus.iter().any(|&c| c >= libc::CPU_SETSIZE as usize) {
        return false;
    }
    // SAFETY: cpu_set_t is plain data; CPU_SET writes inside it (every cpu < CPU_SETSIZE, checked);
    // sched_setaffinity(0) applies to the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = core::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, core::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// Context switches (voluntary and involuntary) of the calling thread so far, from
/// `getrusage(RUSAGE_THREAD)`; 0 if that fails. A timed window with none was never descheduled.
pub fn thread_context_switches() -> u64 {
    // SAFETY: rusage is plain data; getrusage fills it for the calling thread; the result is checked.
    unsafe {
        let mut ru: libc::rusage = core::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_THREAD, &mut ru) != 0 {
            return 0;
        }
        (ru.ru_nvcsw + ru.ru_nivcsw) as u64
    }
}

/// CPU time of the calling thread (`CLOCK_THREAD_CPUTIME_ID`); zero if the clock fails.
pub fn thread_cpu_time() -> Duration {
    // SAFETY: timespec is plain data; clock_gettime fills it; the result is checked.
    unsafe {
        let mut ts: libc::timespec = core::mem::zeroed();
        if libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) != 0 {
            return Duration::ZERO;
        }
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }
}

/// The round trip of one cache line between two CPUs, in nanoseconds: a thread on each passes a
/// counter back and forth `rounds` times (each store makes the other CPU fetch the line). What a
/// per-packet shared variable costs; on a VM it depends on where the host runs the two vCPUs
/// (one core's two threads, two cores sharing an L3, or two L3s). `None` if `a == b` or pinning
/// fails.
pub fn line_round_trip_ns(a: usize, b: usize, rounds: u64) -> Option<f64> {
    #[repr(align(128))]
    struct Line(AtomicU64);
    if a == b || rounds == 0 {
        return None;
    }
    let line = Arc::new(Line(AtomicU64::new(u64::MAX)));
    let other = {
        let line = line.clone();
        std::thread::spawn(move || {
            let pinned = pin_current_thread(b);
            // Release: the main thread starts once it sees this.
            line.0.store(if pinned { 0 } else { u64::MAX - 1 }, Ordering::Release);
            if !pinned {
                return;
            }
            for i in 0..rounds {
                // Acquire/Release: the ping-pong orders nothing else; any ordering would do.
                while line.0.load(Ordering::Acquire) != 2 * i + 1 {
                    core::hint::spin_loop();
                }
                line.0.store(2 * i + 2, Ordering::Release);
            }
        })
    };
    let me = allowed_cpus();
    let pinned = pin_current_thread(a);
    let start = loop {
        match line.0.load(Ordering::Acquire) {
            u64::MAX => core::hint::spin_loop(),
            v => break v,
        }
    };
    let mut result = None;
    if pinned && start == 0 {
        let t0 = Instant::now();
        for i in 0..rounds {
            line.0.store(2 * i + 1, Ordering::Release);
            while line.0.load(Ordering::Acquire) != 2 * i + 2 {
                core::hint::spin_loop();
            }
        }
        result = Some(t0.elapsed().as_secs_f64() * 1e9 / rounds as f64);
    } else if start == 0 {
        // The other side waits for a ping it will never get: let it finish.
        for i in 0..rounds {
            line.0.store(2 * i + 1, Ordering::Release);
            while line.0.load(Ordering::Acquire) != 2 * i + 2 {
                std::thread::yield_now();
            }
        }
    }
    let _ = other.join();
    set_current_thread_cpus(&me);
    result
}

/// The time-stamp counter's frequency in Hz, measured against the monotonic clock over ~200 ms
/// (to turn DPDK's cycle counts into nanoseconds). `None` off x86-64.
pub fn tsc_hz() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: rdtsc has no preconditions on x86-64.
        let c0 = unsafe { core::arch::x86_64::_rdtsc() };
        let t0 = Instant::now();
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: as above.
        let c1 = unsafe { core::arch::x86_64::_rdtsc() };
        let dt = t0.elapsed().as_secs_f64();
        Some(c1.wrapping_sub(c0) as f64 / dt)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// The memory of one model instance: queue struct, guest pool, host packet pool.
struct Model {
    f: Factors,
    qsize: usize,
    avail_idx_off: usize,
    used_idx_off: usize,
    desc_off: usize,
    stride: usize,
    queue: Region,
    guest: Region,
    host: Region,
    pool_buffers: usize,
}

// SAFETY: the model's regions are accessed by the two threads under the packed-ring protocol
// (flags with Release/Acquire) and otherwise only through atomics.
unsafe impl Sync for Model {}

impl Model {
    fn new(cfg: &StudyConfig) -> Result<Model> {
        let f = cfg.factors;
        let qsize = cfg.queue_size;
        let descs = (qsize * f.desc_bytes()).next_multiple_of(64);
        let (avail_idx_off, used_idx_off, desc_off, qbytes) = if f.a {
            // last_avail_idx line, guard, descriptors, guard, last_used_idx line, guard.
            (0, 128 + descs + 64, 128, 128 + descs + 64 + 128)
        } else {
            // Both indices packed at the head, descriptors right after (16-aligned).
            (0, 4, 16, 16 + descs)
        };
        let stride = cfg.stride();
        let queue = Region::anonymous(qbytes)?;
        let guest = Region::anonymous(cfg.pool_buffers * stride)?;
        let host = Region::anonymous(SOURCE_PACKETS * stride)?;
        // Fault every page in before timing.
        // SAFETY: each region is at least as long as written here and private to this thread.
        unsafe {
            core::ptr::write_bytes(guest.as_ptr(), 0, cfg.pool_buffers * stride);
            core::ptr::write_bytes(host.as_ptr(), 0, SOURCE_PACKETS * stride);
            for p in 0..SOURCE_PACKETS {
                let pkt = host.as_ptr().add(p * stride + f.header_bytes());
                for w in 0..PACKET_BYTES / 8 {
                    pkt.cast::<u64>().add(w).write(p as u64 + w as u64);
                }
            }
        }
        Ok(Model {
            f,
            qsize,
            avail_idx_off,
            used_idx_off,
            desc_off,
            stride,
            queue,
            guest,
            host,
            pool_buffers: cfg.pool_buffers,
        })
    }

    #[inline(always)]
    fn u32_at(&self, off: usize) -> &AtomicU32 {
        // SAFETY: offsets are inside the queue region and 4-aligned (see `new`).
        unsafe { &*self.queue.as_ptr().add(off).cast::<AtomicU32>() }
    }

    #[inline(always)]
    fn desc(&self, i: usize) -> *mut u8 {
        // SAFETY: i < qsize, so the descriptor is inside the queue region.
        unsafe { self.queue.as_ptr().add(self.desc_off + i * self.f.desc_bytes()) }
    }

    #[inline(always)]
    fn flags(&self, i: usize) -> &AtomicU16 {
        let at = if self.f.c { 6 } else { 14 };
        // SAFETY: inside descriptor i, 2-aligned.
        unsafe { &*self.desc(i).add(at).cast::<AtomicU16>() }
    }

    #[inline(always)]
    fn buffer(&self, b: usize) -> *mut u8 {
        // SAFETY: b < pool_buffers.
        unsafe { self.guest.as_ptr().add(b * self.stride) }
    }

    /// Writes descriptor i's body: buffer b, length.
    #[inline(always)]
    fn write_desc(&self, i: usize, b: usize, len: usize) {
        let d = self.desc(i);
        // SAFETY: the descriptor is inside the queue and owned by this side until its flags store.
        unsafe {
            if self.f.c {
                d.cast::<u32>().write(b as u32);
                d.add(4).cast::<u16>().write(len as u16);
            } else {
                d.cast::<u64>().write(self.buffer(b) as u64);
                d.add(8).cast::<u32>().write(len as u32);
                d.add(12).cast::<u16>().write(b as u16);
            }
        }
    }

    /// The buffer address descriptor i names.
    #[inline(always)]
    fn desc_buffer(&self, i: usize) -> *mut u8 {
        let d = self.desc(i);
        // SAFETY: inside the queue; the flags load (Acquire) before this made the body visible.
        unsafe {
            if self.f.c {
                self.buffer(d.cast::<u32>().read() as usize)
            } else {
                d.cast::<u64>().read() as *mut u8
            }
        }
    }

    #[inline(always)]
    fn set_len(&self, i: usize, len: usize) {
        let d = self.desc(i);
        // SAFETY: inside the queue; this side owns the descriptor until its flags store.
        unsafe {
            if self.f.c {
                d.add(4).cast::<u16>().write(len as u16);
            } else {
                d.add(8).cast::<u32>().write(len as u32);
            }
        }
    }
}

/// The Rx (vhost back-end) thread.
/// Moves up to `packets`, or until `until` passes; then stores the count moved in `limit` (which
/// the guest reads as its own end) after the last used flag.
fn rx_thread(m: &Model, packets: u64, until: Option<Instant>, limit: &AtomicU64, mode: CopyMode) {
    let mut bursts = 0u32;
    let hdr = m.f.header_bytes();
    let stride = m.stride;
    let mut wrap = true;
    let mut src = 0usize;
    let mut done = 0u64;
    let mut idle = 0u32;
    let mut slots = [0usize; BURST];
    let mut wraps = [false; BURST];
    while done < packets {
        if let Some(t) = until {
            bursts = bursts.wrapping_add(1);
            if bursts.is_multiple_of(64) && Instant::now() >= t {
                break;
            }
        }
        let want = ((packets - done) as usize).min(BURST);
        let mut n = 0;
        while n < want {
            // The device's position lives in the shared struct, read and written per packet.
            // Relaxed: only this thread writes it; it is shared state in the paper's layout.
            let i = m.u32_at(m.avail_idx_off).load(Ordering::Relaxed) as usize;
            // Acquire, pairing with the guest's Release store of the avail flags.
            let fl = m.flags(i).load(Ordering::Acquire);
            if ((fl & F_AVAIL != 0) != wrap) || ((fl & F_USED != 0) == wrap) {
                break;
            }
            let dst = m.desc_buffer(i);
            let mut pkt = [0u8; PACKET_BYTES];
            // SAFETY: the source packet lies inside the host pool (src < SOURCE_PACKETS).
            unsafe {
                let s = m.host.as_ptr().add(src * stride + hdr);
                core::ptr::copy_nonoverlapping(s, pkt.as_mut_ptr(), PACKET_BYTES);
            }
            // Stamp the sequence number (the guest checks it).
            pkt[..8].copy_from_slice(&(done + n as u64).to_le_bytes());
            // SAFETY: `dst` is a guest buffer the guest made available (so ours until the used
            // flag), stride bytes long. For NT copies the sfence below precedes the Release store
            // that publishes the buffer.
            unsafe { copy_bytes(mode, dst.add(hdr), pkt.as_ptr(), PACKET_BYTES) };
            m.set_len(i, PACKET_BYTES);
            src = (src + 1) % SOURCE_PACKETS;
            slots[n] = i;
            wraps[n] = wrap;
            let next = (i + 1) & (m.qsize - 1);
            if next == 0 {
                wrap = !wrap;
            }
            // Relaxed: own state; see above.
            m.u32_at(m.avail_idx_off).store(next as u32, Ordering::Relaxed);
            n += 1;
        }
        if n == 0 {
            idle = idle.wrapping_add(1);
            if idle.is_multiple_of(1024) {
                std::thread::yield_now();
            }
            core::hint::spin_loop();
            continue;
        }
        store_fence(mode);
        for k in 0..n {
            let used = if wraps[k] { F_AVAIL | F_USED } else { 0 };
            // Release, pairing with the guest's Acquire load of the used flags.
            m.flags(slots[k]).store(used, Ordering::Release);
        }
        done += n as u64;
    }
    // Release: every used flag above is visible to a guest that reads this count.
    limit.store(done, Ordering::Release);
}

/// The guest (virtio-net driver) thread. Returns a checksum of the packets read.
/// Reads packets until it has read `limit` (which the Rx thread lowers to its count when it stops).
fn guest_thread(m: &Model, limit: &AtomicU64) -> std::result::Result<u64, String> {
    let hdr = m.f.header_bytes();
    let cap = if m.f.e { PACKET_BYTES } else { 2048 };
    let mut wrap = true;
    // The initial fill used up the first lap of avail wrap counter 1: refills start at 0.
    let mut avail_wrap = false;
    let mut next_buffer = m.qsize % m.pool_buffers;
    let mut done = 0u64;
    let mut sum = 0u64;
    let mut idle = 0u32;
    // Acquire, pairing with the Rx thread's Release store of its final count.
    while done < limit.load(Ordering::Acquire) {
        let mut n = 0;
        while n < BURST {
            // Relaxed: own state stored in the shared struct, per packet (as the paper's model).
            let i = m.u32_at(m.used_idx_off).load(Ordering::Relaxed) as usize;
            // Acquire, pairing with the Rx thread's Release store of the used flags.
            let fl = m.flags(i).load(Ordering::Acquire);
            if ((fl & F_AVAIL != 0) != wrap) || ((fl & F_USED != 0) != wrap) {
                break;
            }
            let buf = m.desc_buffer(i);
            // SAFETY: the buffer was returned used, so it is the guest's; all offsets are inside
            // its stride.
            unsafe {
                if hdr != 0 {
                    // The mbuf header: 128 B of metadata per packet.
                    for w in 0..16 {
                        buf.cast::<u64>().add(w).write_volatile(done ^ w as u64);
                    }
                }
                let pkt = buf.add(hdr).cast::<u64>();
                let seq = u64::from_le(pkt.read_volatile());
                if seq != done + n as u64 {
                    return Err(format!("packet {} carried sequence {seq}", done + n as u64));
                }
                for w in 1..PACKET_BYTES / 8 {
                    sum = sum.wrapping_add(pkt.add(w).read_volatile());
                }
            }
            // Give a fresh buffer back in the same slot (the queue is in order).
            m.write_desc(i, next_buffer, cap);
            next_buffer += 1;
            if next_buffer == m.pool_buffers {
                next_buffer = 0;
            }
            let avail = if avail_wrap { F_AVAIL } else { F_USED };
            // Release, pairing with the Rx thread's Acquire load of the avail flags.
            m.flags(i).store(avail, Ordering::Release);
            let next = (i + 1) & (m.qsize - 1);
            if next == 0 {
                wrap = !wrap;
                avail_wrap = !avail_wrap;
            }
            // Relaxed: own state; see above.
            m.u32_at(m.used_idx_off).store(next as u32, Ordering::Relaxed);
            n += 1;
        }
        if n == 0 {
            idle = idle.wrapping_add(1);
            if idle.is_multiple_of(1024) {
                std::thread::yield_now();
            }
            core::hint::spin_loop();
        }
        done += n as u64;
    }
    Ok(sum)
}

/// Runs the model once.
pub fn run(cfg: &StudyConfig) -> std::result::Result<StudyResult, String> {
    if !cfg.queue_size.is_power_of_two() || cfg.queue_size < 2 || cfg.pool_buffers < 2 * cfg.queue_size {
        return Err("queue size must be a power of two and the pool at least twice as large".into());
    }
    if cfg.factors.c && cfg.pool_buffers > u32::MAX as usize {
        return Err("pool too large for 8 B descriptors".into());
    }
    let model = Arc::new(Model::new(cfg).map_err(|e| e.to_string())?);
    // The guest makes every descriptor available with buffers 0..qsize.
    for i in 0..model.qsize {
        model.write_desc(i, i, if cfg.factors.e { PACKET_BYTES } else { 2048 });
        // Release: published before the threads start (thread spawn also synchronises).
        model.flags(i).store(F_AVAIL, Ordering::Release);
    }
    let ready = Arc::new(AtomicU32::new(0));
    let go = Arc::new(AtomicBool::new(false));
    let pinned_ok = Arc::new(AtomicU32::new(0));
    let mode = if cfg.factors.b { CopyMode::NonTemporal } else { CopyMode::Ordinary };
    let packets = cfg.packets;
    let limit = Arc::new(AtomicU64::new(packets));
    let spawn = |role: usize| {
        let (m, ready, go, pinned_ok) = (model.clone(), ready.clone(), go.clone(), pinned_ok.clone());
        let (limit, duration) = (limit.clone(), cfg.duration);
        let cpu = cfg.cpus.map(|(r, g)| if role == 0 { r } else { g });
        std::thread::spawn(move || {
            if let Some(c) = cpu {
                if pin_current_thread(c) {
                    // Relaxed: a counter read after join.
                    pinned_ok.fetch_add(1, Ordering::Relaxed);
                }
            }
            // Release/Acquire with the main thread's spin on `ready` and store of `go`.
            ready.fetch_add(1, Ordering::Release);
            while !go.load(Ordering::Acquire) {
                core::hint::spin_loop();
            }
            let (cpu0, wall0) = (thread_cpu_time(), Instant::now());
            let r = if role == 0 {
                rx_thread(&m, packets, duration.map(|d| wall0 + d), &limit, mode);
                Ok(0)
            } else {
                guest_thread(&m, &limit)
            };
            let share =
                (thread_cpu_time().saturating_sub(cpu0)).as_secs_f64() / wall0.elapsed().as_secs_f64();
            r.map(|sum| (sum, share))
        })
    };
    let rx = spawn(0);
    let guest = spawn(1);
    while ready.load(Ordering::Acquire) < 2 {
        std::thread::yield_now();
    }
    let t0 = Instant::now();
    go.store(true, Ordering::Release);
    let g = guest.join().map_err(|_| "guest thread panicked".to_string())?;
    let elapsed = t0.elapsed();
    let (_, rx_share) = rx.join().map_err(|_| "rx thread panicked".to_string())??;
    let (sum, guest_share) = g?;
    core::hint::black_box(sum);
    Ok(StudyResult {
        // Acquire: pairs with the Rx thread's store (also ordered by the joins).
        packets: limit.load(Ordering::Acquire),
        elapsed,
        pinned: cfg.cpus.is_some() && pinned_ok.load(Ordering::Relaxed) == 2,
        cpu_share: rx_share.min(guest_share).min(1.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_combination_moves_every_packet_in_order() {
        for (_, f) in Factors::every() {
            for spread in [false, true] {
                let cfg = StudyConfig {
                    factors: f,
                    packets: 20_000,
                    duration: None,
                    queue_size: 64,
                    pool_buffers: 256,
                    cpus: None,
                    spread,
                };
                let r = run(&cfg).unwrap_or_else(|e| panic!("{f:?}: {e}"));
                assert_eq!(r.packets, 20_000);
                assert!(r.mpps() > 0.0);
            }
        }
    }

    #[test]
    fn a_run_with_a_duration_stops_and_counts_what_it_moved() {
        let cfg = StudyConfig {
            packets: u64::MAX,
            duration: Some(Duration::from_millis(50)),
            queue_size: 64,
            pool_buffers: 256,
            ..StudyConfig::new(Factors::default(), 0)
        };
        let r = run(&cfg).unwrap();
        assert!(r.packets > 0 && r.packets < u64::MAX);
        assert!(r.elapsed >= Duration::from_millis(50));
    }

    #[test]
    fn line_round_trip_needs_two_cpus() {
        assert_eq!(line_round_trip_ns(0, 0, 10), None);
        let cpus = allowed_cpus();
        if let [a, b, ..] = cpus[..] {
            assert!(line_round_trip_ns(a, b, 100).is_some_and(|ns| ns > 0.0));
            assert_eq!(allowed_cpus(), cpus, "the caller's affinity is restored");
        }
    }

    #[test]
    fn names_parse() {
        assert_eq!(Factors::parse("base"), Some(Factors::default()));
        assert_eq!(Factors::parse("a+d"), Some(Factors { a: true, d: true, ..Factors::default() }));
        assert_eq!(Factors::parse("all"), Some(Factors { a: true, b: true, c: true, d: true, e: true }));
        assert_eq!(
            Factors::parse("all-b"),
            Some(Factors { a: true, c: true, d: true, e: true, ..Factors::default() })
        );
        assert_eq!(Factors::parse("all-b+e"), Factors::parse("a+c+d"));
        assert_eq!(Factors::parse("x"), None);
        assert_eq!(Factors::parse("all-x"), None);
        let every = Factors::every();
        assert_eq!(every.len(), 32);
        assert_eq!(every[0].0, "base");
        assert_eq!(every[31].0, "all");
        for (name, f) in &every {
            assert_eq!(Factors::parse(name), Some(*f), "{name}");
        }
        assert_eq!(Factors { d: true, e: true, ..Factors::default() }.stride(), 64);
        assert_eq!(Factors::default().stride(), 2176);
    }

    /// The L1 set (64 B lines, 4 KiB per way: 64 sets, as in the L1d of current x86 cores) of
    /// each of the queue's in-flight packets, from buffer `first` on.
    fn l1_sets(cfg: &StudyConfig, first: usize) -> std::collections::BTreeSet<usize> {
        let data = cfg.factors.header_bytes();
        (first..first + cfg.queue_size).map(|b| ((b * cfg.stride() + data) / 64) % 64).collect()
    }

    #[test]
    fn spread_buffers_cover_every_l1_set() {
        for (name, f) in Factors::every() {
            let cfg = StudyConfig { spread: true, ..StudyConfig::new(f, 0) };
            assert_eq!(cfg.stride() / 64 % 2, 1, "{name}: stride {}", cfg.stride());
            assert!(cfg.stride() >= f.stride() && cfg.stride() < f.stride() + 128);
            assert_eq!(l1_sets(&cfg, 1000).len(), 64, "{name}");
        }
        // Without padding, (d)'s 2048 B buffers put the 256 packets in flight in 2 of 64 sets
        // (24 lines of a 12-way L1), and the base's 2176 B buffers in half of them.
        let d = StudyConfig { spread: false, ..StudyConfig::new(Factors::parse("d").unwrap(), 0) };
        assert_eq!(l1_sets(&d, 1000).len(), 2);
        let base = StudyConfig { spread: false, ..StudyConfig::new(Factors::default(), 0) };
        assert_eq!(l1_sets(&base, 1000).len(), 32);
    }
}
