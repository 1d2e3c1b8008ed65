//! The AF_XDP socket: the UMEM (frames shared with the kernel) and its four single-producer,
//! single-consumer rings, mapped into this process.
//!
//! Layer: ports (kernel interface), following `Documentation/networking/af_xdp.rst` and
//! `include/uapi/linux/if_xdp.h`. Ownership of UMEM frames moves with ring entries:
//!
//! - a frame address in the **fill** ring belongs to the kernel until it comes back in an **rx**
//!   descriptor;
//! - a frame address in a **tx** descriptor belongs to the kernel until it comes back in the
//!   **completion** ring;
//! - every other frame is ours: either on the transmit free list or being lent to a callback.
//!
//! We only ever form slices over frames we own, so the kernel never writes memory a Rust
//! reference points to. Ring indices are free-running `u32`s masked on access. The kernel's
//! memory-ordering scheme (`net/xdp/xsk_queue.h`) is:
//!
//! ```text
//! producer                         consumer
//! if (LOAD ->consumer) {  (A)      LOAD.acq ->producer  (C)
//!    STORE $data                   LOAD $data
//!    STORE.rel ->producer (B)      STORE.rel ->consumer (D)
//! }
//! ```
//!
//! and each atomic below names which letter it is and which kernel access it pairs with.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

/// Bytes the kernel reserves in front of each received frame in a UMEM chunk (`XDP_PACKET_HEADROOM`).
pub const XDP_PACKET_HEADROOM: u32 = 256;

/// An anonymous memory mapping, unmapped on drop.
#[derive(Debug)]
struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

impl Mapping {
    /// Maps `len` bytes of `fd` at `offset` (shared), or anonymous memory when `fd` is `None`.
    fn new(len: usize, fd: Option<&OwnedFd>, offset: u64) -> io::Result<Mapping> {
        let (flags, raw_fd) = match fd {
            Some(fd) => (libc::MAP_SHARED | libc::MAP_POPULATE, fd.as_raw_fd()),
            None => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE, -1),
        };
        // SAFETY: a fresh mapping at an address of the kernel's choosing; it aliases nothing in
        // this process.
        let ptr = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                raw_fd,
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        Ok(Mapping { base, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` is exactly the range mmap returned, and nothing borrows it any more
        // (its users hold `&self` of the owner, which is being dropped).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// A mapped ring of `T` (a `u64` frame address for fill/completion, an `xdp_desc` for rx/tx).
#[derive(Debug)]
struct Ring<T: Copy> {
    /// Keeps the ring mapped while the pointers below are in use.
    _map: Mapping,
    producer: NonNull<AtomicU32>,
    consumer: NonNull<AtomicU32>,
    flags: NonNull<AtomicU32>,
    descs: NonNull<T>,
    mask: u32,
    /// Our copy of the index we own (producer for fill/tx, consumer for rx/completion).
    local: u32,
    /// The last value we read of the index the kernel owns.
    cached_remote: u32,
}

impl<T: Copy> Ring<T> {
    /// Maps the ring of `size` entries at page offset `pgoff` of the socket, using the offsets the
    /// kernel reported.
    fn map(fd: &OwnedFd, size: u32, pgoff: u64, off: &libc::xdp_ring_offset) -> io::Result<Ring<T>> {
        let len = off.desc as usize + size as usize * size_of::<T>();
        let map = Mapping::new(len, Some(fd), pgoff)?;
        Ring::over(map, size, off)
    }

    /// A ring laid out in `map` at the offsets `off`.
    fn over(map: Mapping, size: u32, off: &libc::xdp_ring_offset) -> io::Result<Ring<T>> {
        let len = map.len;
        if !size.is_power_of_two() || off.desc as usize + size as usize * size_of::<T>() > len {
            return Err(io::Error::other("ring does not fit its mapping"));
        }
        let at = |o: u64| -> io::Result<NonNull<u8>> {
            if o as usize + 4 > len {
                return Err(io::Error::other("XDP_MMAP_OFFSETS points outside the ring"));
            }
            // SAFETY: `o` is inside the mapping (checked above).
            Ok(unsafe { map.base.add(o as usize) })
        };
        let (producer, consumer, flags) =
            (at(off.producer)?.cast(), at(off.consumer)?.cast(), at(off.flags)?.cast());
        let descs = at(off.desc)?.cast();
        let mut ring =
            Ring { _map: map, producer, consumer, flags, descs, mask: size - 1, local: 0, cached_remote: 0 };
        // Fresh rings start at zero; read them anyway so a mapping's state is what we track.
        ring.local = ring.producer_index().load(Ordering::Relaxed);
        ring.cached_remote = ring.consumer_index().load(Ordering::Relaxed);
        Ok(ring)
    }

    /// The consumer side keeps its index in `local`: fix up after mapping (rx, completion).
    fn into_consumer(mut self) -> Ring<T> {
        self.local = self.consumer_index().load(Ordering::Relaxed);
        self.cached_remote = self.producer_index().load(Ordering::Relaxed);
        self
    }

    fn producer_index(&self) -> &AtomicU32 {
        // SAFETY: points into `self.map` (checked in `map`), 4-aligned as the kernel lays out the
        // ring header, and the kernel accesses it only atomically (READ_ONCE / smp_store_release).
        unsafe { self.producer.as_ref() }
    }

    fn consumer_index(&self) -> &AtomicU32 {
        // SAFETY: as for `producer_index`.
        unsafe { self.consumer.as_ref() }
    }

    fn size(&self) -> u32 {
        self.mask + 1
    }

    /// Whether the kernel asked to be woken (`XDP_RING_NEED_WAKEUP`) to process this ring.
    fn needs_wakeup(&self) -> bool {
        // SAFETY: as for `producer_index`.
        let flags = unsafe { self.flags.as_ref() };
        // Relaxed: the flag is a hint; a stale read costs at most one extra or one late kick,
        // and `Xsk::wait` polls, which wakes the kernel side regardless.
        flags.load(Ordering::Relaxed) & libc::XDP_RING_NEED_WAKEUP != 0
    }

    fn slot(&self, index: u32) -> *mut T {
        // SAFETY: `index & mask < size`, and the mapping holds `size` entries from `descs`.
        unsafe { self.descs.as_ptr().add((index & self.mask) as usize) }
    }

    // ---- we produce (fill, tx) ----

    /// Free slots we may produce into, at least `want` when possible.
    fn free(&mut self, want: u32) -> u32 {
        let mut free = self.size().wrapping_sub(self.local.wrapping_sub(self.cached_remote));
        if free < want {
            // (A) Acquire: pairs with the kernel's STORE.rel of ->consumer (D, xskq_cons_release /
            // __xskq_cons_release), so the kernel is done reading the slots we will overwrite.
            self.cached_remote = self.consumer_index().load(Ordering::Acquire);
            free = self.size().wrapping_sub(self.local.wrapping_sub(self.cached_remote));
        }
        // Distrust: a consumer index ahead of our producer would make this exceed the ring.
        free.min(self.size())
    }

    /// Writes entry `i` (0-based) of the batch being produced.
    fn write(&mut self, i: u32, value: T) {
        // SAFETY: the slot is in the mapping and free (the caller checked `free`), so the kernel
        // does not read it until we publish it in `submit`.
        unsafe { self.slot(self.local.wrapping_add(i)).write(value) };
    }

    /// Publishes `n` written entries to the kernel.
    fn submit(&mut self, n: u32) {
        // Nothing new: no store. A store, even of the same value, takes the index's cache line
        // from the kernel's core, which then waits for it on its next look (every received
        // frame, for the fill ring), and an empty poll would do that on every iteration.
        if n == 0 {
            return;
        }
        self.local = self.local.wrapping_add(n);
        // (B) Release: pairs with the kernel's LOAD.acq of ->producer (C, __xskq_cons_peek), so
        // it sees the entries written above.
        self.producer_index().store(self.local, Ordering::Release);
    }

    /// Entries produced and not yet consumed by the kernel (for deciding whether to kick).
    fn outstanding(&self) -> u32 {
        // Relaxed: only a hint for whether a kick is needed; no data is read on its strength.
        self.local.wrapping_sub(self.consumer_index().load(Ordering::Relaxed)).min(self.size())
    }

    // ---- we consume (rx, completion) ----

    /// Entries ready to be consumed.
    fn ready(&mut self) -> u32 {
        // (C) Acquire: pairs with the kernel's STORE.rel of ->producer (B, __xskq_prod_submit /
        // xskq_prod_submit_n), so the entries up to it are visible.
        self.cached_remote = self.producer_index().load(Ordering::Acquire);
        // Distrust: never read more than a ring's worth.
        self.cached_remote.wrapping_sub(self.local).min(self.size())
    }

    /// Takes the next ready entry (the caller checked [`Ring::ready`]). The slot goes back to the
    /// kernel at the next [`Ring::publish_consumer`]; until then a panic in between cannot make
    /// us read it twice.
    fn take(&mut self) -> T {
        // SAFETY: the slot is in the mapping and was published by the kernel (see `ready`); the
        // kernel does not reuse it before we publish our consumer index past it.
        let value = unsafe { self.slot(self.local).read() };
        self.local = self.local.wrapping_add(1);
        value
    }

    /// Hands the slots taken so far back to the kernel.
    fn publish_consumer(&mut self) {
        // Nothing taken since the last publish: no store (see `submit`). Relaxed: only this side
        // writes the index, so the load reads back our own last store.
        if self.consumer_index().load(Ordering::Relaxed) == self.local {
            return;
        }
        // (D) Release: pairs with the kernel's LOAD of ->consumer (A, xskq_prod_is_full /
        // xskq_prod_nb_free), so our reads of the slots happen before it reuses them.
        self.consumer_index().store(self.local, Ordering::Release);
    }
}

/// How the socket was bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BindMode {
    /// The NIC DMAs straight into UMEM.
    ZeroCopy,
    /// The kernel copies between its buffers and UMEM (every driver; veth always).
    Copy,
}

/// UMEM and ring sizes.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    /// Frames in the UMEM (half receive, half transmit).
    pub frame_count: u32,
    /// Bytes per frame (a power of two, 2048 or 4096).
    pub frame_size: u32,
    /// Entries in each ring (power of two).
    pub ring_size: u32,
}

/// What one receive descriptor completes ([`Gather::take`]).
#[derive(Debug, PartialEq, Eq)]
enum Gathered<'a> {
    /// A whole frame: the descriptor's own bytes, or the chain it ends, gathered.
    Frame(&'a [u8]),
    /// Part of a chain that goes on (or the rest of a chain being skipped).
    Partial,
    /// A bad descriptor, or a chain longer than the largest frame: the frame is dropped (the
    /// rest of its chain is skipped).
    Dropped,
}

/// Multi-buffer receive: gathers a frame from its chain of descriptors (all but the last marked
/// `XDP_PKT_CONTD`), which may end in a later burst. Pure logic, tested against a model.
#[derive(Debug, Default)]
struct Gather {
    chain: Vec<u8>,
    /// The chain was handed out: empty it before the next piece.
    handed_out: bool,
    /// The rest of a dropped chain follows.
    skipping: bool,
}

impl Gather {
    /// Takes the next descriptor: its bytes (`None` if it was bad) and whether more of its frame
    /// follows. Chains longer than `max_chain` bytes are dropped (a frame in one descriptor is
    /// bounded by its UMEM frame already).
    fn take<'a>(&'a mut self, piece: Option<&'a [u8]>, more: bool, max_chain: usize) -> Gathered<'a> {
        if std::mem::take(&mut self.handed_out) {
            self.chain.clear();
        }
        if self.skipping {
            self.skipping = more;
            return Gathered::Partial;
        }
        let Some(piece) = piece else { return self.drop(more) };
        if !more && self.chain.is_empty() {
            return Gathered::Frame(piece);
        }
        if self.chain.len() + piece.len() > max_chain {
            return self.drop(more);
        }
        self.chain.extend_from_slice(piece);
        if more {
            return Gathered::Partial;
        }
        self.handed_out = true;
        Gathered::Frame(&self.chain)
    }

    fn drop(&mut self, more: bool) -> Gathered<'static> {
        self.chain.clear();
        self.skipping = more;
        Gathered::Dropped
    }
}

/// An AF_XDP socket with its UMEM and rings.
#[derive(Debug)]
pub struct Xsk {
    // Field order is drop order: the socket closes first, then the rings and UMEM are unmapped.
    fd: OwnedFd,
    rx: Ring<libc::xdp_desc>,
    tx: Ring<libc::xdp_desc>,
    fill: Ring<u64>,
    comp: Ring<u64>,
    umem: Mapping,
    frame_size: u32,
    /// Transmit frames we own (with multi-buffer: the first UMEM frame of each free slot of
    /// `chain` consecutive ones).
    free_tx: Vec<u64>,
    /// Receive frames consumed from rx and not yet back in the fill ring.
    refill: Vec<u64>,
    /// Receive frames kept out of the fill ring, and the batch it is topped up in (see
    /// `refill_fill_ring`). `refill` is a stack: the frames at its bottom stay there, so
    /// `fill_hold` frames of the UMEM's receive half never reach the kernel.
    fill_hold: u32,
    fill_batch: u32,
    bind_mode: BindMode,
    /// UMEM frames one frame may take. Above 1 the socket is bound with `XDP_USE_SG` (frames
    /// are chains of descriptors, all but the last with `XDP_PKT_CONTD`), and the transmit half
    /// of UMEM is cut into slots of `chain` consecutive frames (one frame each otherwise), one
    /// per frame sent, filled in place as one buffer.
    chain: u32,
    /// The first transmit slot's address, and per slot the descriptors the kernel has yet to
    /// complete (the slot is free again when they all are).
    tx_base: u64,
    slot_pending: Vec<u8>,
    /// Multi-buffer receive: the frame being gathered from its chain (it may end in the next
    /// burst).
    gather: Gather,
    /// Busy polling is on: empty receives and every transmit enter the kernel, which polls the
    /// device queue in that system call (the port then sends no lone frames around the ring).
    busy_poll: bool,
    /// Copy mode: the plain `AF_PACKET` socket a burst of one frame goes out through instead of
    /// the tx ring (see [`Xsk::send_lone_frames_through`]).
    lone: Option<OwnedFd>,
    /// Descriptors the rx ring delivered that pointed outside UMEM (never expected).
    pub(crate) bad_descs: u64,
    /// Frames sent through `lone`.
    pub(crate) lone_frames: u64,
}

// SAFETY: the mappings and descriptor belong to this value alone; the raw pointers point into
// those mappings, and nothing is tied to the creating thread. (Not `Sync`: the rings are
// single-producer, single-consumer on our side.)
unsafe impl Send for Xsk {}

fn setsockopt<T>(fd: &OwnedFd, level: i32, name: i32, value: &T) -> io::Result<()> {
    // SAFETY: `value` is a live `T` and we pass its exact size.
    let rc = unsafe {
        libc::setsockopt(fd.as_raw_fd(), level, name, (value as *const T).cast(), size_of::<T>() as u32)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl Xsk {
    /// Creates the socket, registers a fresh UMEM, maps the rings, puts the receive half of the
    /// frames in the fill ring (less `fill_hold`, see `refill_fill_ring`) and binds to
    /// `ifindex`/`queue` with need-wakeup, zero-copy first when `try_zero_copy` (falling back to
    /// copy mode), copy mode otherwise; with
    /// `chain` above 1 (UMEM frames a frame may take), also with `XDP_USE_SG` (Linux 6.6+), for
    /// frames larger than a UMEM frame.
    /// Errors name the step that failed.
    pub fn create(
        ifindex: u32,
        queue: u32,
        geo: Geometry,
        try_zero_copy: bool,
        chain: u32,
    ) -> Result<Xsk, (&'static str, io::Error)> {
        let chain = chain.max(1);
        // SAFETY: plain socket(2) call.
        let raw = unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(("socket(AF_XDP)", io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };

        let umem_len = geo.frame_count as usize * geo.frame_size as usize;
        let umem = Mapping::new(umem_len, None, 0).map_err(|e| ("mmap UMEM", e))?;
        let reg = libc::xdp_umem_reg {
            addr: umem.base.as_ptr() as u64,
            len: umem_len as u64,
            chunk_size: geo.frame_size,
            headroom: 0,
            flags: 0,
            tx_metadata_len: 0,
        };
        setsockopt(&fd, libc::SOL_XDP, libc::XDP_UMEM_REG, &reg).map_err(|e| ("XDP_UMEM_REG", e))?;
        let n = geo.ring_size as i32;
        for (name, opt) in [
            ("XDP_UMEM_FILL_RING", libc::XDP_UMEM_FILL_RING),
            ("XDP_UMEM_COMPLETION_RING", libc::XDP_UMEM_COMPLETION_RING),
            ("XDP_RX_RING", libc::XDP_RX_RING),
            ("XDP_TX_RING", libc::XDP_TX_RING),
        ] {
            setsockopt(&fd, libc::SOL_XDP, opt, &n).map_err(|e| (name, e))?;
        }

        // SAFETY: all-zero is a valid xdp_mmap_offsets (plain integers).
        let mut off: libc::xdp_mmap_offsets = unsafe { core::mem::zeroed() };
        let mut len = size_of::<libc::xdp_mmap_offsets>() as u32;
        // SAFETY: `off` is writable for `len` bytes; the kernel writes at most that and sets `len`.
        let rc = unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                libc::SOL_XDP,
                libc::XDP_MMAP_OFFSETS,
                (&raw mut off).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(("XDP_MMAP_OFFSETS", io::Error::last_os_error()));
        }
        if len as usize != size_of::<libc::xdp_mmap_offsets>() {
            // Kernels before 5.4 report offsets without the flags word: no need-wakeup support.
            return Err((
                "XDP_MMAP_OFFSETS",
                io::Error::new(
                    io::ErrorKind::Unsupported,
                    "kernel too old for XDP need-wakeup (needs Linux 5.4+)",
                ),
            ));
        }
        let size = geo.ring_size;
        let rx =
            Ring::map(&fd, size, libc::XDP_PGOFF_RX_RING as u64, &off.rx).map_err(|e| ("mmap rx ring", e))?;
        let tx =
            Ring::map(&fd, size, libc::XDP_PGOFF_TX_RING as u64, &off.tx).map_err(|e| ("mmap tx ring", e))?;
        let fill = Ring::map(&fd, size, libc::XDP_UMEM_PGOFF_FILL_RING, &off.fr)
            .map_err(|e| ("mmap fill ring", e))?;
        let comp = Ring::map(&fd, size, libc::XDP_UMEM_PGOFF_COMPLETION_RING, &off.cr)
            .map_err(|e| ("mmap completion ring", e))?;

        let rx_frames = (geo.frame_count / 2).min(geo.ring_size);
        // Batches of a 64-byte line of 8-byte entries, two lines behind the kernel (see
        // `refill_fill_ring`), when the receive half is large enough that the kernel still has
        // its minimum of whole chains without the frames held; else every frame at once.
        const HOLD: u32 = 16;
        const BATCH: u32 = 8;
        let most_held = HOLD + BATCH - 1;
        let (fill_hold, fill_batch) =
            if rx_frames >= 64 && (rx_frames - most_held) as usize >= super::MIN_CHAINS * chain as usize {
                (HOLD, BATCH)
            } else {
                (0, 1)
            };
        let mut xsk = Xsk {
            fd,
            rx: rx.into_consumer(),
            tx,
            fill,
            comp: comp.into_consumer(),
            umem,
            frame_size: geo.frame_size,
            free_tx: (0..(geo.frame_count - rx_frames) / chain)
                .rev()
                .map(|slot| u64::from(rx_frames + slot * chain) * u64::from(geo.frame_size))
                .collect(),
            refill: (0..rx_frames).map(|i| u64::from(i) * u64::from(geo.frame_size)).collect(),
            fill_hold,
            fill_batch,
            bind_mode: BindMode::Copy,
            chain,
            tx_base: u64::from(rx_frames) * u64::from(geo.frame_size),
            slot_pending: vec![0; ((geo.frame_count - rx_frames) / chain) as usize],
            gather: Gather::default(),
            busy_poll: false,
            lone: None,
            bad_descs: 0,
            lone_frames: 0,
        };
        xsk.refill_fill_ring();

        let bind = |flags: u16| -> io::Result<()> {
            let addr = libc::sockaddr_xdp {
                sxdp_family: libc::AF_XDP as u16,
                sxdp_flags: flags | libc::XDP_USE_NEED_WAKEUP | if chain > 1 { libc::XDP_USE_SG } else { 0 },
                sxdp_ifindex: ifindex,
                sxdp_queue_id: queue,
                sxdp_shared_umem_fd: 0,
            };
            // SAFETY: `addr` is a live sockaddr_xdp of the size passed.
            let rc = unsafe {
                libc::bind(
                    xsk.fd.as_raw_fd(),
                    (&raw const addr).cast(),
                    size_of::<libc::sockaddr_xdp>() as u32,
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        };
        // A socket closed just before (by a port dropped and reopened, say) releases its claim on
        // the queue from a kernel work item (xp_release_deferred), so for a moment the queue still
        // looks taken: retry EBUSY briefly before reporting it.
        let bind = |flags: u16| -> io::Result<()> {
            let mut tries = 0;
            loop {
                match bind(flags) {
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 100 => {
                        tries += 1;
                        std::thread::sleep(std::time::Duration::from_millis(5));
                    }
                    other => return other,
                }
            }
        };
        let zero_copy = try_zero_copy
            && match bind(libc::XDP_ZEROCOPY) {
                Ok(()) => true,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => return Err(("bind", e)),
                Err(_) => false,
            };
        if !zero_copy {
            bind(libc::XDP_COPY).map_err(|e| ("bind", e))?;
        }
        xsk.bind_mode = if zero_copy { BindMode::ZeroCopy } else { BindMode::Copy };
        Ok(xsk)
    }

    /// Turns on busy polling (`SO_PREFER_BUSY_POLL`, `SO_BUSY_POLL` for `usecs`,
    /// `SO_BUSY_POLL_BUDGET`); from then on an empty receive makes a system call that polls.
    pub fn set_busy_poll(&mut self, usecs: u32, budget: u32) -> io::Result<()> {
        const SO_PREFER_BUSY_POLL: i32 = 69;
        const SO_BUSY_POLL_BUDGET: i32 = 70;
        setsockopt(&self.fd, libc::SOL_SOCKET, SO_PREFER_BUSY_POLL, &1i32)?;
        setsockopt(&self.fd, libc::SOL_SOCKET, libc::SO_BUSY_POLL, &(usecs as i32))?;
        setsockopt(&self.fd, libc::SOL_SOCKET, SO_BUSY_POLL_BUDGET, &(budget as i32))?;
        self.busy_poll = true;
        Ok(())
    }

    /// The socket (for the XSKMAP, poll and socket options).
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// From now on a burst of one frame goes out through `socket` (a plain `AF_PACKET` socket
    /// bound to the interface, the qdisc bypassed like AF_XDP's own transmit) whenever the tx
    /// ring holds nothing older; longer bursts still go through the ring, one `sendto` for up to
    /// 32 frames.
    ///
    /// Meant for copy mode, where AF_XDP's transmit is itself a copy into an skb inside the
    /// `sendto` kick, but a costlier one than `AF_PACKET`'s: it walks the tx ring, sends each
    /// skb through `__dev_direct_xmit` and completes it from its destructor into the completion
    /// ring, which the next call must reap. Measured on a veth between two namespaces, lanbus's
    /// busy 64 B ping-pong, `tx=auto` against `tx=ring` of one build in alternating runs: the
    /// system call that sends a reply (on a veth it also runs the receiver's whole kernel path)
    /// is shorter, and so is the round trip. Sending every frame this way cost streaming goodput
    /// (a system call per frame instead of per 32), hence one-frame bursts only.
    ///
    /// Both paths hand frames to the driver inside the system call, so on a device with one
    /// transmit queue (a veth by default) they arrive in the order sent. With several, the socket
    /// may pick another queue than the ring's, and a lone frame may then overtake ring frames
    /// still queued: the transport recovers from that as from a loss.
    pub fn send_lone_frames_through(&mut self, socket: OwnedFd) {
        self.lone = Some(socket);
    }

    /// How the socket is bound.
    pub fn bind_mode(&self) -> BindMode {
        self.bind_mode
    }

    /// Bytes per UMEM frame.
    pub fn frame_size(&self) -> u32 {
        self.frame_size
    }

    /// (Transmit slots free now, after taking in completions; transmit slots in all.) A slot is
    /// one UMEM frame, or `chain` of them with multi-buffer.
    #[cfg(test)]
    pub(crate) fn tx_slots(&mut self) -> (usize, usize) {
        self.reap_completions();
        (self.free_tx.len(), self.slot_pending.len())
    }

    /// Whether a frame may take several UMEM frames (bound with `XDP_USE_SG`).
    pub fn multi_buffer(&self) -> bool {
        self.chain > 1
    }

    /// Gives received frames back to the kernel through the fill ring: whole batches, keeping
    /// `fill_hold` frames back.
    ///
    /// Why not every frame at once: with the ring full, the entry we write is the one right
    /// behind the kernel's next read, in the cache line it is reading, so every received frame
    /// moved that line to our core and back (its reads are in the sender's transmit path on a
    /// veth). Kept 16 entries short, our writes land two lines behind its reads, a whole line
    /// (8 entries) at a time: one transfer each way per 8 frames.
    fn refill_fill_ring(&mut self) {
        let held = self.refill.len() as u32;
        if held < self.fill_hold + self.fill_batch {
            return;
        }
        let want = held - self.fill_hold;
        let n = self.fill.free(want).min(want) / self.fill_batch * self.fill_batch;
        for i in 0..n {
            let addr = self.refill[self.refill.len() - 1 - i as usize];
            self.fill.write(i, addr);
        }
        self.fill.submit(n);
        self.refill.truncate(self.refill.len() - n as usize);
    }

    /// Moves transmitted frames from the completion ring back to the free list.
    fn reap_completions(&mut self) {
        let n = self.comp.ready();
        for _ in 0..n {
            let addr = self.comp.take();
            // Distrust: only addresses inside a transmit slot count, and a slot goes back on the
            // free list only once all its descriptors are back.
            let slot_bytes = u64::from(self.chain) * u64::from(self.frame_size);
            let slot = addr.checked_sub(self.tx_base).map(|o| o / slot_bytes);
            let slot = slot.and_then(|i| usize::try_from(i).ok());
            match slot.and_then(|i| self.slot_pending.get_mut(i).map(|p| (i, p))) {
                Some((i, pending)) if *pending > 0 => {
                    *pending -= 1;
                    if *pending == 0 {
                        self.free_tx.push(self.tx_base + i as u64 * slot_bytes);
                    }
                }
                _ => self.bad_descs += 1,
            }
        }
        self.comp.publish_consumer();
    }

    fn frame_base(&self, addr: u64) -> u64 {
        addr & !(u64::from(self.frame_size) - 1)
    }

    /// A kick: tells the kernel there is work on the tx ring (copy mode transmits inside this
    /// call) or that the fill ring has entries again.
    fn kick(&self) -> io::Result<()> {
        // SAFETY: sendto with no buffer is the documented AF_XDP wake-up; no memory is passed.
        let rc = unsafe {
            libc::sendto(self.fd.as_raw_fd(), core::ptr::null(), 0, libc::MSG_DONTWAIT, core::ptr::null(), 0)
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            // The kernel is busy or out of buffers: the entries stay in the ring and the next kick
            // (or poll) sends them. ENETDOWN: the link went down under us; same handling.
            match e.raw_os_error() {
                Some(libc::EAGAIN | libc::EBUSY | libc::ENOBUFS | libc::ENETDOWN) => return Ok(()),
                _ => return Err(e),
            }
        }
        Ok(())
    }

    /// Receives up to `max` descriptors, lending each frame (its bytes in UMEM, or gathered from
    /// its chain of descriptors when bound for multi-buffer: at most `chain` UMEM frames' worth)
    /// to `on_frame`, then returns UMEM frames to the fill ring (in batches: `refill_fill_ring`).
    /// Returns (frames delivered, bytes delivered).
    pub fn rx_burst(&mut self, max: u32, on_frame: &mut dyn FnMut(&[u8])) -> io::Result<(u32, u64)> {
        let max_chain = self.chain as usize * self.frame_size as usize;
        let n = self.rx.ready().min(max);
        let mut bytes = 0u64;
        let mut delivered = 0;
        for _ in 0..n {
            let desc = self.rx.take();
            let base = self.frame_base(desc.addr);
            let more = desc.options & libc::XDP_PKT_CONTD != 0;
            // Distrust: the frame must be one of ours and lie inside its UMEM chunk, and only a
            // socket bound for multi-buffer gets chains.
            let inside = base < self.umem.len as u64;
            if inside {
                // The frame goes back to the fill ring at the end of this call or a later one (see
                // `refill_fill_ring`): in any case after the borrow below has ended.
                self.refill.push(base);
            }
            let valid = inside
                && desc.addr - base + u64::from(desc.len) <= u64::from(self.frame_size)
                && (self.chain > 1 || !more);
            // SAFETY: the kernel handed this frame to us in an rx descriptor; it lies inside the
            // UMEM mapping (checked above) and the kernel does not write it until we put it in the
            // fill ring, which happens only after this borrow has ended (`Gather` copies what it
            // keeps).
            let piece = valid.then(|| unsafe {
                core::slice::from_raw_parts(
                    self.umem.base.as_ptr().add(desc.addr as usize),
                    desc.len as usize,
                )
            });
            if let Some(piece) = piece {
                // Written by the kernel on the sending core: see `crate::cache`.
                crate::cache::prefetch_lines(piece);
            }
            match self.gather.take(piece, more, max_chain) {
                Gathered::Frame(frame) => {
                    on_frame(frame);
                    bytes += frame.len() as u64;
                    delivered += 1;
                }
                Gathered::Partial => {}
                Gathered::Dropped => self.bad_descs += 1,
            }
        }
        self.rx.publish_consumer();
        self.refill_fill_ring();
        if n == 0 && (self.busy_poll || self.fill.needs_wakeup()) {
            // The driver sleeps until told the fill ring has buffers (zero-copy drivers do this);
            // with busy polling, this system call is what polls the device queue.
            // SAFETY: recvfrom with no buffer is the documented wake-up for the fill ring.
            unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    core::ptr::null_mut(),
                    0,
                    libc::MSG_DONTWAIT,
                    core::ptr::null_mut(),
                    core::ptr::null_mut(),
                )
            };
        }
        Ok((delivered, bytes))
    }

    /// Transmits up to `max` frames: each is filled by `fill` in place into a free transmit slot
    /// (`chain` consecutive UMEM frames, at most `capacity` bytes of them), then sent as one
    /// descriptor per UMEM frame it covers, all but the last with `XDP_PKT_CONTD`; a burst of
    /// one frame goes out through the lone-frame socket instead, if there is one and the ring
    /// holds nothing older (see [`Xsk::send_lone_frames_through`]). Returns
    /// (frames queued, bytes queued, frames the caller over- or under-filled and that were not
    /// sent).
    pub fn tx_burst(
        &mut self,
        max: u32,
        capacity: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
    ) -> io::Result<(u32, u64, u64)> {
        self.reap_completions();
        let chunk = self.frame_size as usize;
        let capacity = capacity.min(self.chain as usize * chunk);
        let (mut frames, mut descs, mut bytes, mut bad) = (0u32, 0u32, 0u64, 0u64);
        let mut last = (0, 0);
        let mut calls = 0;
        while calls < max && self.tx.free(descs + self.chain) >= descs + self.chain {
            let Some(&base) = self.free_tx.last() else { break };
            calls += 1;
            // SAFETY: `base` starts a slot we own (in `free_tx`: none of its frames is in any
            // ring), `chain` consecutive UMEM frames inside the mapping, and `capacity` is at
            // most their length; the kernel reads them only after we publish the descriptors.
            let buf = unsafe {
                core::slice::from_raw_parts_mut(self.umem.base.as_ptr().add(base as usize), capacity)
            };
            let Some(len) = fill(buf) else { break };
            if len == 0 || len > capacity {
                bad += 1;
                continue; // the slot stays free for the next fill
            }
            self.free_tx.pop();
            let pieces = len.div_ceil(chunk);
            for i in 0..pieces {
                let piece = chunk.min(len - i * chunk);
                let options = if i + 1 < pieces { libc::XDP_PKT_CONTD } else { 0 };
                let addr = base + (i * chunk) as u64;
                self.tx.write(descs, libc::xdp_desc { addr, len: piece as u32, options });
                descs += 1;
            }
            let slot_bytes = u64::from(self.chain) * chunk as u64;
            self.slot_pending[((base - self.tx_base) / slot_bytes) as usize] = pieces as u8;
            frames += 1;
            bytes += len as u64;
            last = (base, len);
        }
        // A lone frame may skip the ring only if nothing queued there earlier must leave first
        // (our own descriptors are not submitted yet, so they do not count).
        if frames == 1 && self.lone.is_some() && self.tx.outstanding() == 0 {
            let (base, len) = last;
            if self.send_lone(base, len) {
                // Its descriptors were never published: the slot is simply free again.
                let slot_bytes = u64::from(self.chain) * chunk as u64;
                self.slot_pending[((base - self.tx_base) / slot_bytes) as usize] = 0;
                self.free_tx.push(base);
                return Ok((frames, bytes, bad));
            }
        }
        if descs > 0 {
            self.tx.submit(descs);
        }
        self.flush_tx()?;
        Ok((frames, bytes, bad))
    }

    /// Sends the `len`-byte frame at UMEM offset `base` through the lone-frame socket, if there
    /// is one; false if there is none or the send failed (the caller then uses the ring, which
    /// reports a lasting failure its own way).
    fn send_lone(&mut self, base: u64, len: usize) -> bool {
        let Some(fd) = &self.lone else { return false };
        // SAFETY: [base, base + len) lies inside UMEM (a transmit slot we own, filled by the
        // caller); send(2) only reads it.
        let rc = unsafe {
            libc::send(
                fd.as_raw_fd(),
                self.umem.base.as_ptr().add(base as usize).cast(),
                len,
                libc::MSG_DONTWAIT,
            )
        };
        let sent = rc == len as isize;
        self.lone_frames += u64::from(sent);
        sent
    }

    /// Kicks the kernel until what the tx ring holds is sent (see `tx_burst`).
    fn flush_tx(&mut self) -> io::Result<()> {
        // Kick when the kernel asks (copy mode always does: it transmits inside sendto, at most
        // 32 frames per call), also for entries an earlier kick left behind. Keep kicking while
        // each kick makes progress, so what we queued is on the wire when we return.
        let mut outstanding = self.tx.outstanding();
        while outstanding > 0 && (self.busy_poll || self.tx.needs_wakeup()) {
            self.kick()?;
            self.reap_completions();
            let now = self.tx.outstanding();
            if now >= outstanding {
                break; // no progress (out of buffers, link down): the next call retries
            }
            outstanding = now;
        }
        Ok(())
    }

    /// Receive frames held out of the fill ring, and the fill ring's producer index (tests).
    #[cfg(test)]
    pub(crate) fn fill_state(&self) -> (u32, u32) {
        (self.refill.len() as u32, self.fill.local)
    }

    /// Whether a received frame is waiting.
    pub fn rx_ready(&mut self) -> bool {
        self.rx.ready() > 0
    }

    /// Kernel statistics (`XDP_STATISTICS`).
    pub fn statistics(&self) -> io::Result<libc::xdp_statistics> {
        // SAFETY: all-zero is valid for this struct of integers.
        let mut st: libc::xdp_statistics = unsafe { core::mem::zeroed() };
        let mut len = size_of::<libc::xdp_statistics>() as u32;
        // SAFETY: `st` is writable for `len` bytes.
        let rc = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_XDP,
                libc::XDP_STATISTICS,
                (&raw mut st).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(st)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    /// A ring in anonymous memory whose indices both start at `start`, with the kernel's side
    /// played by the test through the same shared words.
    fn ring(size: u32, start: u32) -> Ring<u64> {
        let off = libc::xdp_ring_offset { producer: 0, consumer: 64, flags: 128, desc: 192 };
        let map = Mapping::new(192 + size as usize * 8, None, 0).unwrap();
        let ring = Ring::<u64>::over(map, size, &off).unwrap();
        ring.producer_index().store(start, Ordering::Relaxed);
        ring.consumer_index().store(start, Ordering::Relaxed);
        ring
    }

    /// xorshift64: deterministic, no dependencies.
    fn next(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    /// Random frames cut into chains of pieces, with bad descriptors, oversize frames and chains
    /// that a burst boundary would cut anywhere (`take` is called one descriptor at a time): what
    /// comes out is exactly the frames whose pieces were all good and that fit, in order, and
    /// each bad frame is counted once.
    #[test]
    fn gather_delivers_good_chains_whole_and_drops_bad_ones_once() {
        const MAX: usize = 9014;
        let mut g = Gather::default();
        let mut rng = 0x2545_F491_4F6C_DD1Du64;
        let (mut expected, mut got) = (Vec::new(), Vec::new());
        let (mut dropped, mut bad_frames) = (0, 0);
        for seq in 0..5_000u32 {
            let len = 1 + (next(&mut rng) % (MAX as u64 + 4_000)) as usize;
            let frame: Vec<u8> = (0..len).map(|i| (seq as usize * 7 + i) as u8).collect();
            let pieces: Vec<&[u8]> = frame.chunks(1 + (next(&mut rng) % 3_840) as usize).collect();
            // One frame in eight has a bad descriptor somewhere in its chain.
            let bad_at =
                next(&mut rng).is_multiple_of(8).then(|| (next(&mut rng) % pieces.len() as u64) as usize);
            if bad_at.is_some() || len > MAX {
                bad_frames += 1;
            } else {
                expected.push(frame.clone());
            }
            for (i, p) in pieces.iter().enumerate() {
                let piece = if bad_at == Some(i) { None } else { Some(*p) };
                match g.take(piece, i + 1 < pieces.len(), MAX) {
                    Gathered::Frame(f) => got.push(f.to_vec()),
                    Gathered::Partial => {}
                    Gathered::Dropped => dropped += 1,
                }
            }
        }
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "frames differ");
        assert_eq!(dropped, bad_frames);
    }

    #[test]
    fn a_chain_cut_by_a_bad_descriptor_skips_to_its_end_and_the_next_frame_arrives() {
        let mut g = Gather::default();
        assert_eq!(g.take(Some(b"ab"), true, 100), Gathered::Partial);
        assert_eq!(g.take(None, true, 100), Gathered::Dropped);
        assert_eq!(g.take(Some(b"cd"), true, 100), Gathered::Partial);
        assert_eq!(g.take(Some(b"ef"), false, 100), Gathered::Partial);
        assert_eq!(g.take(Some(b"gh"), false, 100), Gathered::Frame(b"gh"));
        assert_eq!(g.take(Some(b"ij"), true, 3), Gathered::Partial);
        assert_eq!(g.take(Some(b"kl"), false, 3), Gathered::Dropped);
        assert_eq!(g.take(Some(b"m"), true, 3), Gathered::Partial);
        assert_eq!(g.take(Some(b"no"), false, 3), Gathered::Frame(b"mno"));
    }

    #[test]
    fn producer_side_behaves_like_a_queue_across_index_wrap() {
        let mut r = ring(8, u32::MAX - 40);
        r.local = r.producer_index().load(Ordering::Relaxed);
        r.cached_remote = r.consumer_index().load(Ordering::Relaxed);
        let mut model = VecDeque::new();
        let (mut rng, mut value) = (0x9E37_79B9_7F4A_7C15u64, 0u64);
        for _ in 0..10_000 {
            if next(&mut rng).is_multiple_of(2) {
                // We produce up to k entries.
                let k = (next(&mut rng) % 6) as u32;
                let free = r.free(k);
                // The cached count may be stale but only ever low; below `k` it is refreshed.
                let actual = 8 - model.len() as u32;
                assert!(free <= actual && (free >= k || free == actual), "free {free} of {actual}");
                let n = k.min(free);
                for i in 0..n {
                    r.write(i, value);
                    model.push_back(value);
                    value += 1;
                }
                r.submit(n);
            } else {
                // The kernel consumes up to j entries.
                let j = next(&mut rng) % 6;
                let prod = r.producer_index().load(Ordering::Acquire);
                let mut cons = r.consumer_index().load(Ordering::Relaxed);
                for _ in 0..j {
                    if cons == prod {
                        break;
                    }
                    // SAFETY: the slot was published by the producer side above.
                    let entry = unsafe { r.slot(cons).read() };
                    assert_eq!(Some(entry), model.pop_front());
                    cons = cons.wrapping_add(1);
                }
                r.consumer_index().store(cons, Ordering::Release);
            }
            assert_eq!(r.outstanding(), model.len() as u32);
        }
        assert!(r.local < 100_000, "the producer index wrapped around u32");
    }

    #[test]
    fn consumer_side_behaves_like_a_queue_across_index_wrap() {
        let mut r = ring(16, u32::MAX - 70).into_consumer();
        let mut model = VecDeque::new();
        let (mut rng, mut value) = (0xD1B5_4A32_D192_ED03u64, 0u64);
        for _ in 0..10_000 {
            if next(&mut rng).is_multiple_of(2) {
                // The kernel produces up to k entries into free slots.
                let k = next(&mut rng) % 9;
                let cons = r.consumer_index().load(Ordering::Acquire);
                let mut prod = r.producer_index().load(Ordering::Relaxed);
                for _ in 0..k {
                    if prod.wrapping_sub(cons) == 16 {
                        break;
                    }
                    // SAFETY: the slot is free (between consumer and producer + size).
                    unsafe { r.slot(prod).write(value) };
                    model.push_back(value);
                    value += 1;
                    prod = prod.wrapping_add(1);
                }
                r.producer_index().store(prod, Ordering::Release);
            } else {
                // We consume up to j entries.
                let j = (next(&mut rng) % 9) as u32;
                let ready = r.ready();
                assert_eq!(ready, model.len() as u32);
                for _ in 0..j.min(ready) {
                    assert_eq!(Some(r.take()), model.pop_front());
                }
                r.publish_consumer();
            }
        }
        assert!(r.local < 100_000, "the consumer index wrapped around u32");
    }

    #[test]
    fn a_runaway_kernel_index_never_yields_more_than_a_ring() {
        let mut r = ring(8, 0).into_consumer();
        r.producer_index().store(1_000, Ordering::Release);
        assert_eq!(r.ready(), 8);
        let mut p = ring(8, 0);
        p.consumer_index().store(500, Ordering::Release);
        assert_eq!(p.free(8), 8);
    }
}
