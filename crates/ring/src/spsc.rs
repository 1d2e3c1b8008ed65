//! Single-producer single-consumer ring of `Pod` elements, in one process or across two.
//!
//! Layer: rings. The layout follows DPDK's `rte_ring` (`rte_ring_core.h`) and the vhost-user
//! cache-efficiency study (factor (a)): every variable one core writes and the other reads sits on
//! its own cache line, with an unused guard line after each so the adjacent-line prefetcher does
//! not pull the neighbour's line in:
//!
//! ```text
//! offset   0  config line   magic, capacity, element size (written once by `format`)
//! offset  64  producer line  tail: next index the producer writes (free-running u32)
//! offset 128  guard line
//! offset 192  consumer line  head: next index the consumer reads (free-running u32)
//! offset 256  guard line
//! offset 320  wait line      consumer "about to sleep" flag for eventfd wake-ups
//! offset 384  slots          capacity * size_of::<T>(), capacity a power of two
//! ```
//!
//! Invariants: indices run freely and wrap at 2^32; a slot is `index & (capacity - 1)`; always
//! `tail - head <= capacity` (wrapping). Each side keeps its own index privately (the copy in shared
//! memory is only published, never read back) and caches the other side's, reloading it only when
//! the cached value says the ring is full (producer) or empty (consumer). A reloaded index that
//! breaks `tail - head <= capacity` can only come from a faulty peer: the call returns
//! [`Error::Corrupt`] and touches no slot. Slot positions are masked, so no index value whatever can
//! make either side access memory outside the ring.
//!
//! Across two cores the cost is cache-line transfers, not instructions. After publishing a burst the
//! producer asks for the next burst's slot lines with PREFETCHW (where the CPU has it), limited to
//! slots its cached head says are free: the transfer of those lines from the consumer's core then
//! overlaps the producer's other work instead of stalling its next stores one round trip per line.
//! With `lanbus bench ring` (DPDK's two-core method) this cuts the cost per element at bursts 8 and
//! 32 when the producer stays ahead of the consumer (`docs/performance.md`, "Rings", has the figures).

use std::sync::Arc;

use crate::sync::{fence, AtomicU32, CacheAligned, Ordering};
use crate::{Error, Pod, Result};

/// The magic number in a ring's config line ("LBRG").
pub const RING_MAGIC: u32 = 0x4c42_5247;

/// Byte offsets inside a formatted ring (for tests and tools that inspect shared memory).
pub mod layout {
    /// The producer's published index (u32).
    pub const TAIL: usize = 64;
    /// The consumer's published index (u32).
    pub const HEAD: usize = 192;
    /// The consumer's wait flag (u32).
    pub const WAITING: usize = 320;
    /// Where the slots start.
    pub const SLOTS: usize = 384;
}

#[repr(C)]
struct Config {
    magic: u32,
    capacity: u32,
    elem_size: u32,
}

/// The shared header of a ring; see the module docs for the layout.
#[repr(C)]
pub(crate) struct RingHeader {
    config: CacheAligned<Config>,
    tail: CacheAligned<AtomicU32>,
    _guard0: [u8; 64],
    head: CacheAligned<AtomicU32>,
    _guard1: [u8; 64],
    waiting: CacheAligned<AtomicU32>,
}

const _: () = assert!(core::mem::size_of::<RingHeader>() == layout::SLOTS);

/// Bytes a ring of `capacity` elements of `T` occupies in a region (a multiple of 64).
pub fn bytes_needed<T: Pod>(capacity: u32) -> usize {
    (layout::SLOTS + capacity as usize * core::mem::size_of::<T>()).next_multiple_of(64)
}

fn check_capacity(capacity: u32) -> Result<()> {
    if capacity.is_power_of_two() && capacity <= 1 << 24 {
        Ok(())
    } else {
        Err(Error::Misuse("ring capacity must be a power of two no larger than 2^24"))
    }
}

#[cfg(not(loom))]
mod storage {
    use super::*;
    use crate::region::Region;

    /// What keeps the ring's memory alive.
    pub(crate) type Keep = Arc<Region>;

    /// The slot array: a raw pointer into the region.
    pub(crate) struct Slots<T> {
        ptr: *mut T,
    }

    /// Runs of up to this many bytes (one cache line) are copied inline; longer ones go to
    /// `memcpy`, whose wide vector moves win once the call is amortised (measured: burst 32 of u64
    /// is faster through `memcpy`, burst 8 inline).
    const INLINE_COPY_MAX_BYTES: usize = 64;

    /// Copies `n` elements from `src` to `dst`; the slot side (`dst` when `TO_SLOTS`, else `src`)
    /// is accessed with volatile operations. Bursts are short (8 to 32 elements here), and for
    /// the shortest a call into libc's `memcpy` (which `copy_nonoverlapping` with a run-time length
    /// becomes, and which LLVM also makes of a plain copy loop) costs more than the copy itself:
    /// profiling the one-core bench at burst 8 showed it. Volatile slot accesses keep the loop a
    /// loop (LLVM never turns volatile accesses into a `memcpy` call) and also fit the shared
    /// memory, which a peer process may write at any time: each slot is read exactly once. Four
    /// elements move per step (DPDK's `ENQUEUE_PTRS` unrolls by four too), then the rest singly.
    ///
    /// # Safety
    /// `src` is valid for reading and `dst` for writing `n` elements of `T`, both aligned, and the
    /// two ranges do not overlap.
    #[inline(always)]
    unsafe fn copy_run<T: Pod, const TO_SLOTS: bool>(src: *const T, dst: *mut T, n: usize) {
        if n * core::mem::size_of::<T>() > INLINE_COPY_MAX_BYTES {
            // SAFETY: the caller's contract.
            unsafe { core::ptr::copy_nonoverlapping(src, dst, n) };
            return;
        }
        let mut k = 0;
        while k + 4 <= n {
            // SAFETY: k + 4 <= n, so the four elements lie inside both ranges; [T; 4] has T's
            // alignment; T is Pod, so copying its bytes makes a valid value.
            unsafe {
                let (s, d) = (src.add(k).cast::<[T; 4]>(), dst.add(k).cast::<[T; 4]>());
                if TO_SLOTS {
                    d.write_volatile(s.read());
                } else {
                    d.write(s.read_volatile());
                }
            }
            k += 4;
        }
        while k < n {
            // SAFETY: k < n: inside both ranges, aligned.
            unsafe {
                if TO_SLOTS {
                    dst.add(k).write_volatile(src.add(k).read());
                } else {
                    dst.add(k).write(src.add(k).read_volatile());
                }
            }
            k += 1;
        }
    }

    /// Whether this CPU has PREFETCHW (CPUID 8000_0001h ECX bit 8, "3dnowprefetch" in
    /// /proc/cpuinfo; Intel since Broadwell, AMD for much longer). Asked once per attach.
    pub(crate) fn has_prefetch_write() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use core::arch::x86_64::__cpuid;
            __cpuid(0x8000_0000).eax >= 0x8000_0001 && __cpuid(0x8000_0001).ecx & (1 << 8) != 0
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    impl<T: Pod> Slots<T> {
        pub(crate) fn new(ptr: *mut T) -> Self {
            Slots { ptr }
        }

        /// Asks for the cache lines of slots `start..start + n` in the exclusive (writable) state,
        /// without waiting: PREFETCHW. Only called when [`has_prefetch_write`] said yes.
        ///
        /// Why: a store to a line another core holds must first take the line from it (a
        /// read-for-ownership, one cross-core round trip), and stores leave the store buffer in
        /// order, so a producer that writes a burst's slots and then `tail` waits for those round
        /// trips one after the other on every burst. Asking for the
        /// next burst's lines right after publishing this one starts that transfer while the
        /// caller does other work (or waits for its next burst), so the next writes find the
        /// lines already owned. A plain read prefetch (PREFETCHT0) does not do it: it brings the
        /// line shared, and the store still has to invalidate the other copy (measured: slower
        /// than no prefetch at all).
        #[inline(always)]
        pub(crate) fn prefetch_for_write(&self, start: usize, n: usize) {
            if n == 0 {
                return;
            }
            let first = self.ptr.wrapping_add(start) as usize & !63;
            let last = (self.ptr.wrapping_add(start + n) as usize - 1) & !63;
            let mut line = first;
            while line <= last {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: PREFETCHW (checked present by the caller) is a hint: it never faults and
                // changes no architectural state (no memory, no flags), whatever the address.
                unsafe {
                    core::arch::asm!("prefetchw [{0}]", in(reg) line, options(nostack, preserves_flags, readonly));
                }
                line += 64;
            }
        }

        /// Copies slots `start..start + out.len()` into `out`.
        ///
        /// # Safety
        /// The range is below capacity, and the protocol gives this side the slots (consumer:
        /// published by the producer and not yet released).
        #[inline(always)]
        pub(crate) unsafe fn read_run(&self, start: usize, out: &mut [T]) {
            // SAFETY: in bounds by the caller's contract; `out` is private memory. The values are
            // copied out once, so a faulty peer rewriting them meanwhile can only change what we
            // read (T is Pod: any bits are a value), never make us read twice.
            unsafe { copy_run::<T, false>(self.ptr.add(start), out.as_mut_ptr(), out.len()) }
        }

        /// Copies `items` into slots `start..start + items.len()`.
        ///
        /// # Safety
        /// The range is below capacity, and the protocol gives this side the slots (producer:
        /// released by the consumer); the consumer reads none of them before the Release store of
        /// `tail` that follows.
        #[inline(always)]
        pub(crate) unsafe fn write_run(&self, start: usize, items: &[T]) {
            // SAFETY: in bounds and exclusively ours by the caller's contract.
            unsafe { copy_run::<T, true>(items.as_ptr(), self.ptr.add(start), items.len()) }
        }
    }
}

#[cfg(loom)]
mod storage {
    use super::*;

    /// What keeps the ring's memory alive (the loom header).
    pub(crate) type Keep = Arc<RingHeader>;

    /// The slot array as loom cells, so loom reports any access not ordered by the index protocol.
    pub(crate) struct Slots<T> {
        cells: Arc<[loom::cell::UnsafeCell<T>]>,
    }

    impl<T: Pod> Slots<T> {
        pub(crate) fn new_loom(capacity: usize) -> Self {
            // SAFETY: T is Pod, so all-zero bytes are a valid value.
            let cells = (0..capacity).map(|_| loom::cell::UnsafeCell::new(unsafe { core::mem::zeroed() }));
            Slots { cells: cells.collect() }
        }

        /// No prefetching under loom (a hint with no effect on the memory model).
        pub(crate) fn prefetch_for_write(&self, _start: usize, _n: usize) {}

        pub(crate) fn clone_ref(&self) -> Self {
            Slots { cells: self.cells.clone() }
        }

        /// # Safety
        /// As the non-loom version.
        pub(crate) unsafe fn read_run(&self, start: usize, out: &mut [T]) {
            for (k, o) in out.iter_mut().enumerate() {
                // SAFETY: loom checks that no write to this cell is concurrent with the read.
                *o = self.cells[start + k].with(|p| unsafe { *p });
            }
        }

        /// # Safety
        /// As the non-loom version.
        pub(crate) unsafe fn write_run(&self, start: usize, items: &[T]) {
            for (k, v) in items.iter().enumerate() {
                // SAFETY: loom checks that no other access to this cell is concurrent with the write.
                self.cells[start + k].with_mut(|p| unsafe { *p = *v });
            }
        }
    }
}

use storage::{Keep, Slots};

struct Ring<T> {
    hdr: *const RingHeader,
    slots: Slots<T>,
    mask: u32,
    capacity: u32,
    _keep: Keep,
}

// SAFETY: the ring's memory is kept alive by `_keep`; the producer and consumer halves access it
// only through atomics and through slots the index protocol hands to one side at a time.
unsafe impl<T: Pod> Send for Ring<T> {}

impl<T: Pod> Ring<T> {
    #[inline(always)]
    fn hdr(&self) -> &RingHeader {
        // SAFETY: `hdr` points to a header inside memory that `_keep` keeps mapped; the header's
        // fields are atomics or plain u32s written before the ring was shared.
        unsafe { &*self.hdr }
    }
}

/// Creates an in-process ring of `capacity` (a power of two) elements.
pub fn channel<T: Pod>(capacity: u32) -> Result<(Producer<T>, Consumer<T>)> {
    check_capacity(capacity)?;
    #[cfg(not(loom))]
    {
        let region = Arc::new(crate::Region::anonymous(bytes_needed::<T>(capacity))?);
        format::<T>(&region, 0, capacity)?;
        Ok((Producer::attach(region.clone(), 0)?, Consumer::attach(region, 0)?))
    }
    #[cfg(loom)]
    {
        let hdr = Arc::new(RingHeader {
            config: CacheAligned(Config { magic: RING_MAGIC, capacity, elem_size: 0 }),
            tail: CacheAligned(AtomicU32::new(0)),
            _guard0: [0; 64],
            head: CacheAligned(AtomicU32::new(0)),
            _guard1: [0; 64],
            waiting: CacheAligned(AtomicU32::new(0)),
        });
        let slots = Slots::new_loom(capacity as usize);
        let ring =
            |slots| Ring { hdr: Arc::as_ptr(&hdr), slots, mask: capacity - 1, capacity, _keep: hdr.clone() };
        let p = Producer { ring: ring(slots.clone_ref()), tail: 0, cached_head: 0, prefetch: false };
        let c = Consumer { ring: ring(slots), head: 0, cached_tail: 0 };
        Ok((p, c))
    }
}

/// Writes an empty ring of `capacity` elements of `T` at `offset` in `region` (64-byte aligned,
/// [`bytes_needed`] long). Done once, by the side that creates the shared memory, before the peer
/// attaches.
#[cfg(not(loom))]
pub fn format<T: Pod>(region: &crate::Region, offset: usize, capacity: u32) -> Result<()> {
    check_capacity(capacity)?;
    let base = region.range(offset, bytes_needed::<T>(capacity), 64)?;
    // SAFETY: `base..base+bytes_needed` is inside the region (checked), 64-byte aligned; no handle
    // to this ring exists yet, so plain writes race with nobody in this process.
    unsafe {
        core::ptr::write_bytes(base, 0, layout::SLOTS);
        let cfg = base.cast::<Config>();
        (*cfg).magic = RING_MAGIC;
        (*cfg).capacity = capacity;
        (*cfg).elem_size = core::mem::size_of::<T>() as u32;
    }
    Ok(())
}

/// Reads and validates a ring's config line at `offset`: magic, element size, capacity, bounds.
#[cfg(not(loom))]
fn attach<T: Pod>(region: Arc<crate::Region>) -> impl FnOnce(usize) -> Result<Ring<T>> {
    move |offset| {
        let base = region.range(offset, layout::SLOTS, 64)?;
        // SAFETY: the config line is inside the region (checked); volatile reads because the peer
        // may be writing it: each field is fetched once and validated below.
        let (magic, capacity, elem_size) = unsafe {
            let cfg = base.cast::<Config>();
            (
                core::ptr::addr_of!((*cfg).magic).read_volatile(),
                core::ptr::addr_of!((*cfg).capacity).read_volatile(),
                core::ptr::addr_of!((*cfg).elem_size).read_volatile(),
            )
        };
        if magic != RING_MAGIC {
            return Err(Error::Corrupt("ring magic missing (not a formatted ring)"));
        }
        if elem_size as usize != core::mem::size_of::<T>() {
            return Err(Error::Corrupt("ring element size differs from this side's type"));
        }
        check_capacity(capacity).map_err(|_| Error::Corrupt("ring capacity is not a power of two"))?;
        region.range(offset, bytes_needed::<T>(capacity), 64)?;
        // SAFETY: the slots lie inside the region (checked just above) and are aligned: 64-byte
        // aligned base + 384, and Pod types have alignment at most 64.
        let slots = unsafe { base.add(layout::SLOTS) }.cast::<T>();
        Ok(Ring { hdr: base.cast(), slots: Slots::new(slots), mask: capacity - 1, capacity, _keep: region })
    }
}

/// The producing half. Not `Clone`: exactly one producer.
///
/// Aligned to 128 bytes (two cache lines, the adjacent-line prefetch pair): its private indices
/// are written on every call, so they must not share a line with anything the consumer's thread
/// writes (a handle moved into a thread's heap-allocated closure can otherwise land next to the
/// other thread's buffers: false sharing). A precaution: no measurable change in `bench ring`.
#[repr(align(128))]
pub struct Producer<T: Pod> {
    ring: Ring<T>,
    /// Our own index (authoritative; the shared copy is only published).
    tail: u32,
    /// The consumer's index as last loaded.
    cached_head: u32,
    /// Whether to prefetch the next burst's slots for writing (the CPU has PREFETCHW).
    prefetch: bool,
}

/// The consuming half. Not `Clone`: exactly one consumer.
///
/// Aligned to 128 bytes for the same reason as [`Producer`].
#[repr(align(128))]
pub struct Consumer<T: Pod> {
    ring: Ring<T>,
    /// Our own index (authoritative; the shared copy is only published).
    head: u32,
    /// The producer's index as last loaded.
    cached_tail: u32,
}

impl<T: Pod> core::fmt::Debug for Producer<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Producer").field("tail", &self.tail).field("capacity", &self.ring.capacity).finish()
    }
}

impl<T: Pod> core::fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Consumer").field("head", &self.head).field("capacity", &self.ring.capacity).finish()
    }
}

impl<T: Pod> Producer<T> {
    /// Attaches the producer to a ring formatted at `offset` in a (possibly peer-made) region,
    /// validating its config and current indices.
    #[cfg(not(loom))]
    pub fn attach(region: Arc<crate::Region>, offset: usize) -> Result<Self> {
        let ring = attach::<T>(region)(offset)?;
        // Acquire, pairing with the peer's Release stores of its index (a consumer that attached
        // earlier): we then see the slots as it left them. Relaxed would do for a fresh ring.
        let tail = ring.hdr().tail.load(Ordering::Acquire);
        let head = ring.hdr().head.load(Ordering::Acquire);
        if tail.wrapping_sub(head) > ring.capacity {
            return Err(Error::Corrupt("ring indices out of range at attach"));
        }
        Ok(Producer { ring, tail, cached_head: head, prefetch: storage::has_prefetch_write() })
    }

    /// The ring's capacity.
    pub fn capacity(&self) -> usize {
        self.ring.capacity as usize
    }

    /// Free slots, reloading the consumer's index only if the cache says fewer than `want`.
    #[inline(always)]
    fn free(&mut self, want: u32) -> Result<u32> {
        let cap = self.ring.capacity;
        let free = cap - self.tail.wrapping_sub(self.cached_head);
        if free >= want {
            return Ok(free);
        }
        // Acquire, pairing with the consumer's Release store of `head` in `dequeue`: the consumer's
        // reads of the slots it released happen before our overwriting them.
        let head = self.ring.hdr().head.load(Ordering::Acquire);
        let used = self.tail.wrapping_sub(head);
        if used > cap {
            return Err(Error::Corrupt("consumer index out of range"));
        }
        self.cached_head = head;
        Ok(cap - used)
    }

    #[inline(always)]
    fn write_and_publish(&mut self, items: &[T]) {
        let start = (self.tail & self.ring.mask) as usize;
        // At most two runs: up to the end of the array, then from its start.
        let first = items.len().min(self.ring.capacity as usize - start);
        // SAFETY: both runs lie below capacity (start is masked, first <= capacity - start, and
        // items.len() <= capacity); `free` showed these slots after tail are released by the
        // consumer, and it reads none of them until the store below.
        unsafe {
            self.ring.slots.write_run(start, &items[..first]);
            if first < items.len() {
                self.ring.slots.write_run(0, &items[first..]);
            }
        }
        self.tail = self.tail.wrapping_add(items.len() as u32);
        // Release, pairing with the consumer's Acquire load of `tail` in `available`: the slot
        // writes above happen before the consumer reads them.
        self.ring.hdr().tail.store(self.tail, Ordering::Release);
        if self.prefetch {
            // Start taking the next burst's lines (assumed the size of this one), as far as the
            // array's end, and only slots the cached head says the consumer has released: never a
            // line the consumer may still be reading.
            let next = (self.tail & self.ring.mask) as usize;
            let free = (self.ring.capacity - self.tail.wrapping_sub(self.cached_head)) as usize;
            let n = items.len().min(free).min(self.ring.capacity as usize - next);
            self.ring.slots.prefetch_for_write(next, n);
        }
    }

    /// Enqueues as many of `items` as fit; returns how many (0 when full).
    #[inline]
    pub fn enqueue_burst(&mut self, items: &[T]) -> Result<usize> {
        let want = items.len().min(self.ring.capacity as usize) as u32;
        let n = self.free(want)?.min(want) as usize;
        if n > 0 {
            self.write_and_publish(&items[..n]);
        }
        Ok(n)
    }

    /// Enqueues all of `items` or none; returns whether it did.
    #[inline]
    pub fn enqueue_bulk(&mut self, items: &[T]) -> Result<bool> {
        if items.len() > self.ring.capacity as usize {
            return Ok(false);
        }
        if (self.free(items.len() as u32)? as usize) < items.len() {
            return Ok(false);
        }
        self.write_and_publish(items);
        Ok(true)
    }

    /// Enqueues one element; `Ok(false)` when the ring is full.
    #[inline]
    pub fn try_push(&mut self, item: T) -> Result<bool> {
        self.enqueue_bulk(core::slice::from_ref(&item))
    }

    /// Whether the consumer said it is about to sleep and should be woken (write its eventfd).
    /// Call after publishing. Pairs with [`Consumer::prepare_wait`]: each side stores its own
    /// flag/index, then a SeqCst fence, then loads the other's, so at least one of them sees the
    /// other's store and a wake-up is never lost.
    pub fn wake_needed(&self) -> bool {
        // SeqCst fence: orders our Release store of `tail` before the load of `waiting` (a plain
        // Release/Acquire pair would allow the store-load reordering that loses wake-ups).
        fence(Ordering::SeqCst);
        // Relaxed: ordering comes from the fence above, pairing with the fence in prepare_wait.
        self.ring.hdr().waiting.load(Ordering::Relaxed) != 0
    }
}

impl<T: Pod> Consumer<T> {
    /// Attaches the consumer to a ring formatted at `offset` in a (possibly peer-made) region,
    /// validating its config and current indices.
    #[cfg(not(loom))]
    pub fn attach(region: Arc<crate::Region>, offset: usize) -> Result<Self> {
        let ring = attach::<T>(region)(offset)?;
        // Acquire, pairing with the producer's Release store of `tail`: slots it published are
        // visible to us.
        let tail = ring.hdr().tail.load(Ordering::Acquire);
        let head = ring.hdr().head.load(Ordering::Acquire);
        if tail.wrapping_sub(head) > ring.capacity {
            return Err(Error::Corrupt("ring indices out of range at attach"));
        }
        Ok(Consumer { ring, head, cached_tail: tail })
    }

    /// The ring's capacity.
    pub fn capacity(&self) -> usize {
        self.ring.capacity as usize
    }

    /// Elements ready, reloading the producer's index only if the cache says fewer than `want`.
    #[inline(always)]
    fn available(&mut self, want: u32) -> Result<u32> {
        let ready = self.cached_tail.wrapping_sub(self.head);
        if ready >= want {
            return Ok(ready);
        }
        // Acquire, pairing with the producer's Release store of `tail` in `write_and_publish`: the
        // producer's slot writes happen before our reads of them.
        let tail = self.ring.hdr().tail.load(Ordering::Acquire);
        let ready = tail.wrapping_sub(self.head);
        if ready > self.ring.capacity {
            return Err(Error::Corrupt("producer index out of range"));
        }
        self.cached_tail = tail;
        Ok(ready)
    }

    #[inline(always)]
    fn read_and_release(&mut self, out: &mut [T]) {
        let start = (self.head & self.ring.mask) as usize;
        let first = out.len().min(self.ring.capacity as usize - start);
        let (a, b) = out.split_at_mut(first);
        // SAFETY: both runs lie below capacity (as in write_and_publish); `available` showed
        // these slots are published by the producer (its Release store of tail was observed by
        // our Acquire load), and the producer does not overwrite them before our store below.
        unsafe {
            self.ring.slots.read_run(start, a);
            if !b.is_empty() {
                self.ring.slots.read_run(0, b);
            }
        }
        self.head = self.head.wrapping_add(out.len() as u32);
        // Release, pairing with the producer's Acquire load of `head` in `free`: our slot reads
        // happen before the producer reuses the slots.
        self.ring.hdr().head.store(self.head, Ordering::Release);
    }

    /// Dequeues up to `out.len()` elements into `out`; returns how many (0 when empty).
    #[inline]
    pub fn dequeue_burst(&mut self, out: &mut [T]) -> Result<usize> {
        let want = out.len().min(self.ring.capacity as usize) as u32;
        let n = self.available(want)?.min(want) as usize;
        if n > 0 {
            self.read_and_release(&mut out[..n]);
        }
        Ok(n)
    }

    /// Fills all of `out` or takes nothing; returns whether it did.
    #[inline]
    pub fn dequeue_bulk(&mut self, out: &mut [T]) -> Result<bool> {
        if out.len() > self.ring.capacity as usize {
            return Ok(false);
        }
        if (self.available(out.len() as u32)? as usize) < out.len() {
            return Ok(false);
        }
        self.read_and_release(out);
        Ok(true)
    }

    /// Dequeues one element.
    #[inline]
    pub fn try_pop(&mut self) -> Result<Option<T>> {
        let mut one = [T::zeroed()];
        Ok(if self.dequeue_bulk(&mut one)? { Some(one[0]) } else { None })
    }

    /// Elements ready now (loads the producer's index).
    pub fn len(&mut self) -> Result<usize> {
        self.available(u32::MAX).map(|n| n as usize)
    }

    /// Whether nothing is ready now (loads the producer's index if the cache says empty).
    pub fn is_empty(&mut self) -> Result<bool> {
        self.available(1).map(|n| n == 0)
    }

    /// Announces that the consumer is about to block. Then re-check [`Consumer::is_empty`]: only if
    /// the ring is still empty may the consumer sleep (on its eventfd); call
    /// [`Consumer::finish_wait`] when awake. See [`Producer::wake_needed`] for the pairing.
    pub fn prepare_wait(&self) {
        // Relaxed store + SeqCst fence: the fence orders this store before the re-check's load of
        // `tail`, pairing with the SeqCst fence in `Producer::wake_needed`.
        self.ring.hdr().waiting.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Clears the wait flag after waking (or after the re-check found work).
    pub fn finish_wait(&self) {
        // Relaxed: a stale 1 seen by the producer only costs a spurious eventfd write.
        self.ring.hdr().waiting.store(0, Ordering::Relaxed);
    }
}
