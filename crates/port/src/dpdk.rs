//! The `dpdk` port: lanbus frames through a DPDK ethdev (any NIC DPDK drives, or a virtual device
//! such as `net_af_packet`), built only with the cargo feature `dpdk`.
//!
//! Layer: ports. Spec: `dpdk:<EAL arguments>`, e.g.
//! `dpdk:--no-huge --no-pci -m 256 --vdev=net_af_packet0,iface=eth1 -l 0`. [`open`] initialises
//! DPDK's EAL with those arguments (split at whitespace; no quoting), then configures the ethdev
//! [`DpdkOptions::port_id`] (0, the first probed device, by default) with one receive and one
//! transmit queue and a mempool of mbufs, and starts it.
//!
//! The DPDK calls live in a small C shim (`crates/port/dpdk/shim.c`, declared in `dpdk/ffi.rs`): DPDK's
//! rx/tx bursts and mbuf accessors are static inline functions Rust cannot call. Rust handles
//! mbufs only as opaque pointers plus the (data, length) pairs the shim reads out of them.
//!
//! Invariants:
//! - The EAL is initialised at most once per process (DPDK's rule). [`eal_init`] remembers the
//!   arguments; a later call with the same arguments is a no-op, with different ones an error
//!   ([`PortError::Misuse`]). A failed init cannot be retried in the same process either.
//! - One [`DpdkPort`] per ethdev at a time. Dropping it stops and closes the ethdev; a closed
//!   virtual device is gone, so it cannot be opened again in the same process.
//! - Receive lends each mbuf's data to the callback, then frees the burst. Frames that are not
//!   lanbus (EtherType other than 0x88B5), shorter than an Ethernet header, or spread over several
//!   mbufs are counted in `rx_dropped` and freed.
//! - Transmit allocates mbufs, lets the caller fill each one in place, and sends them. Frames the
//!   device does not accept at once stay in a small backlog inside the port and go first on the
//!   next `tx_burst` (or `wait`); while the backlog is not empty, `tx_burst` takes no new frames.
//!   No frame the caller filled is dropped for back-pressure.
//!
//! Idle waiting: DPDK is poll-mode and offers no file descriptor to block on (its interrupt mode
//! is driver-specific and absent from most virtual devices). [`Port::wait`] therefore polls the
//! receive queue itself, sleeping between polls with a back-off that doubles from [`NAP_MIN`] to
//! [`NAP_MAX`]; it returns as soon as a poll finds frames (kept for the next `rx_burst`, not lost)
//! or the timeout passes. So a frame arriving on an idle port is seen within about the current
//! nap (plus the kernel's timer slack), and an idle port wakes at most ~1,000 times a second.
//! Latency-critical drivers spin on `rx_burst` instead of calling `wait`.
//!
//! Threads: the port does not use EAL lcores; it is polled by whichever one thread owns it, and may
//! be moved between threads. The EAL makes the thread that calls [`eal_init`] its main lcore and
//! pins it to the first core of `-l`/`--lcores`; the shim restores that thread's CPU affinity
//! afterwards, so the pinning does not leak into threads spawned later. Pin the driver thread
//! yourself (taskset, sched_setaffinity) if wanted.

mod ffi;

use core::ffi::{c_char, c_int, c_uint, c_void, CStr};
use core::time::Duration;
use std::collections::BTreeSet;
use std::ffi::CString;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use lanbus_wire::{ethernet, EtherType, MacAddr};

use crate::{Port, PortCounters, PortError, Result};

/// The DPDK version the shim was built against (from `pkg-config --modversion libdpdk`).
pub const DPDK_VERSION: &str = env!("LANBUS_DPDK_VERSION");

/// [`Port::wait`]'s first sleep between polls of the receive queue.
pub const NAP_MIN: Duration = Duration::from_micros(10);

/// [`Port::wait`]'s longest sleep between polls: the worst added latency for a frame that arrives
/// after a long idle spell.
pub const NAP_MAX: Duration = Duration::from_millis(1);

/// Frames moved per call into the shim (the arrays on the stack).
const BURST: usize = 32;

/// Ethernet header plus one VLAN tag: the bytes beyond the MTU a receive buffer must hold.
const FRAME_OVERHEAD: usize = ethernet::HEADER_LEN + 4;

/// How the ethdev is set up. `Default` gives the first probed port, MAC filtering, 8191 mbufs and
/// 1024 descriptors per queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DpdkOptions {
    /// Which ethdev (DPDK port id): 0 is the first device the EAL probed.
    pub port_id: u16,
    /// Receive every frame on the wire (promiscuous mode) instead of the NIC's MAC filter (own
    /// address, broadcast, multicast).
    pub promiscuous: bool,
    /// Mbufs in the port's mempool (shared by receive and transmit). Must exceed the receive
    /// descriptors plus the transmit descriptors in flight.
    pub mbufs: u32,
    /// Receive ring size (the driver may adjust it).
    pub rx_descriptors: u16,
    /// Transmit ring size (the driver may adjust it).
    pub tx_descriptors: u16,
    /// Set the link MTU (Ethernet payload bytes); `None` keeps the device's.
    pub mtu: Option<u16>,
}

impl Default for DpdkOptions {
    fn default() -> Self {
        DpdkOptions {
            port_id: 0,
            promiscuous: false,
            mbufs: 8191,
            rx_descriptors: 1024,
            tx_descriptors: 1024,
            mtu: None,
        }
    }
}

/// What the EAL's one initialisation in this process came to.
enum EalState {
    Uninit,
    /// Initialised with these arguments (normalised: single spaces).
    Ready(String),
    /// Failed with this message; DPDK does not allow a second attempt.
    Failed(String, String),
}

static EAL: Mutex<EalState> = Mutex::new(EalState::Uninit);

/// Ethdev ports opened by a live [`DpdkPort`] and ports already closed (gone for good).
struct Ports {
    open: BTreeSet<u16>,
    closed: BTreeSet<u16>,
}

static PORTS: Mutex<Ports> = Mutex::new(Ports { open: BTreeSet::new(), closed: BTreeSet::new() });

fn spec_of(eal_args: &str) -> String {
    format!("dpdk:{eal_args}")
}

fn dpdk_strerror(err: c_int) -> String {
    // SAFETY: lb_dpdk_strerror returns a pointer to a static or thread-local NUL-terminated
    // string (rte_strerror), valid at least until the next call on this thread; it is copied at
    // once.
    let msg = unsafe { CStr::from_ptr(ffi::lb_dpdk_strerror(err)) };
    format!("{} (errno {})", msg.to_string_lossy(), err.unsigned_abs())
}

/// Splits the EAL arguments of a `dpdk:` spec at whitespace.
pub fn split_eal_args(eal_args: &str) -> Vec<String> {
    eal_args.split_whitespace().map(str::to_string).collect()
}

/// Initialises DPDK's EAL with `eal_args` (whitespace-separated, as after `dpdk:` in a spec),
/// once per process. A repeat call with the same arguments does nothing; one with different
/// arguments, or any call after a failed initialisation, is an error that says so.
///
/// Virtual devices (`--vdev=net_af_packet0,iface=...`) open their sockets here, in the calling
/// thread's network namespace.
pub fn eal_init(eal_args: &str) -> Result<()> {
    let words = split_eal_args(eal_args);
    let normalised = words.join(" ");
    let spec = spec_of(eal_args);
    let mut state = EAL.lock().unwrap_or_else(|p| p.into_inner());
    match &*state {
        EalState::Ready(done) if *done == normalised => return Ok(()),
        EalState::Ready(done) => {
            return Err(PortError::Misuse(format!(
                "DPDK's EAL is already initialised in this process with arguments {done:?}; it can be \
                 initialised only once, so {normalised:?} cannot take effect (use one `dpdk:` spec per \
                 process, with every --vdev/-a it needs)"
            )))
        }
        EalState::Failed(args, why) => {
            return Err(PortError::Unavailable {
                spec,
                why: format!(
                    "DPDK's EAL initialisation with {args:?} failed earlier in this process ({why}); DPDK \
                     allows one attempt per process"
                ),
            })
        }
        EalState::Uninit => {}
    }
    let mut owned = Vec::with_capacity(words.len() + 1);
    owned.push(CString::new("lanbus").expect("no NUL"));
    for w in &words {
        // Words come from split_whitespace of a &str; a NUL inside is the only way to fail.
        owned.push(CString::new(w.as_str()).map_err(|_| PortError::BadSpec {
            spec: spec.clone(),
            why: "EAL arguments contain a NUL byte".into(),
        })?);
    }
    // The EAL may keep pointers into argv (and permutes the array): give it storage that lives
    // as long as the process. This happens once per process.
    let strings: &'static mut [CString] = Vec::leak(owned);
    let argv: &'static mut [*mut c_char] =
        Vec::leak(strings.iter().map(|s| s.as_ptr().cast_mut()).collect::<Vec<_>>());
    let argc = c_int::try_from(argv.len())
        .map_err(|_| PortError::BadSpec { spec: spec.clone(), why: "too many EAL arguments".into() })?;
    // SAFETY: argv holds argc pointers to NUL-terminated strings that are never freed; the EAL
    // lock guarantees this is the process's only call to rte_eal_init.
    let rc = unsafe { ffi::lb_dpdk_eal_init(argc, argv.as_mut_ptr()) };
    if rc < 0 {
        let why = dpdk_strerror(rc);
        *state = EalState::Failed(normalised.clone(), why.clone());
        return Err(PortError::Unavailable {
            spec,
            why: format!(
                "rte_eal_init failed: {why} (DPDK's log above says more). Check the EAL arguments: \
                 hugepages mounted or --no-huge -m MB, a NIC bound to vfio-pci or a --vdev, root, a \
                 --file-prefix no other DPDK process uses"
            ),
        });
    }
    *state = EalState::Ready(normalised);
    Ok(())
}

/// The DPDK port id of the ethdev called `name`: a virtual device's name as given to `--vdev`
/// without its arguments (`net_ring0`, `net_af_packet0`) or a PCI address (`0000:01:00.0`), for
/// [`DpdkOptions::port_id`]. The EAL must be initialised ([`eal_init`]).
pub fn port_by_name(name: &str) -> Result<u16> {
    if !matches!(*EAL.lock().unwrap_or_else(|p| p.into_inner()), EalState::Ready(_)) {
        return Err(PortError::Misuse("dpdk::port_by_name before the EAL is initialised".into()));
    }
    let c = CString::new(name).map_err(|_| PortError::Misuse(format!("device name {name:?} has a NUL")))?;
    let mut port = 0u16;
    // SAFETY: the EAL is initialised; the name is NUL-terminated; the shim writes one u16.
    let rc = unsafe { ffi::lb_dpdk_port_by_name(c.as_ptr(), &mut port) };
    if rc < 0 {
        return Err(PortError::Unavailable {
            spec: format!("dpdk device {name}"),
            why: format!("no DPDK ethdev named {name:?}: {}", dpdk_strerror(rc)),
        });
    }
    Ok(port)
}

/// Counters the device keeps (`rte_eth_stats_get`), beside the port's own [`PortCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Frames the device received.
    pub ipackets: u64,
    /// Frames the device sent.
    pub opackets: u64,
    /// Bytes received.
    pub ibytes: u64,
    /// Bytes sent.
    pub obytes: u64,
    /// Frames the device dropped because the receive ring was full.
    pub imissed: u64,
    /// Erroneous received frames.
    pub ierrors: u64,
    /// Failed transmissions.
    pub oerrors: u64,
    /// Receive allocation failures (mempool empty).
    pub rx_nombuf: u64,
}

/// A DPDK ethdev as a lanbus [`Port`]. Made by [`open`].
pub struct DpdkPort {
    port_id: u16,
    pool: *mut c_void,
    mac: MacAddr,
    mtu: usize,
    driver: String,
    counters: PortCounters,
    /// Received mbufs not yet handed to the caller (`wait` polls into it; `rx_burst` drains it
    /// first).
    stash: Stash,
    /// Filled mbufs the device has not accepted yet, oldest first: `backlog[head..len]`.
    backlog: [*mut c_void; BURST],
    backlog_head: usize,
    backlog_len: usize,
}

// SAFETY: the raw pointers are DPDK mbufs and a mempool in the process-wide DPDK heap, not tied
// to a thread: mempool get/put from non-EAL threads is supported (no per-lcore cache is used), and
// the ethdev queues are used by whichever single thread holds `&mut DpdkPort`.
unsafe impl Send for DpdkPort {}

impl std::fmt::Debug for DpdkPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DpdkPort")
            .field("port_id", &self.port_id)
            .field("driver", &self.driver)
            .field("mac", &self.mac)
            .field("mtu", &self.mtu)
            .finish_non_exhaustive()
    }
}

/// Opens the `dpdk:<eal_args>` port: initialises the EAL (see [`eal_init`]), then sets up and
/// starts ethdev `options.port_id`.
pub fn open(eal_args: &str, options: DpdkOptions) -> Result<DpdkPort> {
    let spec = spec_of(eal_args);
    eal_init(eal_args)?;
    let port_id = options.port_id;
    let mut ports = PORTS.lock().unwrap_or_else(|p| p.into_inner());
    if ports.open.contains(&port_id) {
        return Err(PortError::Misuse(format!(
            "DPDK port {port_id} is already open in this process (one DpdkPort per ethdev)"
        )));
    }
    // SAFETY: the EAL is initialised; these functions accept any port id.
    let (valid, count) = unsafe { (ffi::lb_dpdk_port_valid(port_id), ffi::lb_dpdk_port_count()) };
    if valid == 0 {
        let why = if ports.closed.contains(&port_id) {
            format!("DPDK port {port_id} was closed earlier in this process and cannot be reopened")
        } else {
            format!(
                "no DPDK port {port_id}: the EAL found {count} port(s). Bind a NIC to vfio-pci \
                 (dpdk-devbind.py -b vfio-pci PCI_ADDR) or add a virtual device such as \
                 --vdev=net_af_packet0,iface=eth1 to the EAL arguments"
            )
        };
        return Err(PortError::Unavailable { spec, why });
    }
    let mut driver_buf = [0 as c_char; 64];
    // SAFETY: the port is valid; the buffer holds 64 bytes and the shim NUL-terminates within.
    let driver = unsafe {
        if ffi::lb_dpdk_port_driver(port_id, driver_buf.as_mut_ptr(), driver_buf.len()) == 0 {
            CStr::from_ptr(driver_buf.as_ptr()).to_string_lossy().into_owned()
        } else {
            "?".to_string()
        }
    };
    let mut current_mtu = 0u16;
    // SAFETY: the port is valid; the shim writes one u16.
    let rc = unsafe { ffi::lb_dpdk_port_mtu(port_id, &mut current_mtu) };
    if rc < 0 {
        return Err(PortError::Unavailable {
            spec,
            why: format!("rte_eth_dev_get_mtu: {}", dpdk_strerror(rc)),
        });
    }
    let mtu = options.mtu.unwrap_or(current_mtu);
    // Every frame fits one mbuf: at least DPDK's usual 2048 bytes, rounded to a cache line.
    let frame_room = (usize::from(mtu) + FRAME_OVERHEAD).max(2048).next_multiple_of(64);
    let frame_room =
        u16::try_from(frame_room).map_err(|_| PortError::Misuse(format!("MTU {mtu} too large")))?;

    static POOLS: AtomicU32 = AtomicU32::new(0);
    // Relaxed: only uniqueness of the name matters.
    let pool_name =
        CString::new(format!("lanbus_p{port_id}_{}", POOLS.fetch_add(1, Ordering::Relaxed))).expect("no NUL");
    let mut pool: *mut c_void = core::ptr::null_mut();
    let mut stage: *const c_char = c"?".as_ptr();
    // SAFETY: the port is valid and not open elsewhere (checked under the PORTS lock, held until
    // the port is registered); the name is NUL-terminated; pool and stage are written by the shim.
    let rc = unsafe {
        ffi::lb_dpdk_port_open(
            port_id,
            pool_name.as_ptr(),
            options.mbufs,
            frame_room,
            options.rx_descriptors,
            options.tx_descriptors,
            options.mtu.unwrap_or(0),
            c_int::from(options.promiscuous),
            &mut pool,
            &mut stage,
        )
    };
    if rc < 0 {
        // SAFETY: the shim sets stage to a static NUL-terminated string.
        let stage = unsafe { CStr::from_ptr(stage) }.to_string_lossy();
        return Err(PortError::Unavailable {
            spec,
            why: format!(
                "setting up DPDK port {port_id} ({driver}): {stage} failed: {}{}",
                dpdk_strerror(rc),
                if stage == "rte_pktmbuf_pool_create" {
                    "; give the EAL more memory (-m MB) or use fewer mbufs"
                } else {
                    ""
                }
            ),
        });
    }
    let mut mac = [0u8; 6];
    // SAFETY: the port is started; the shim writes six bytes.
    let rc = unsafe { ffi::lb_dpdk_port_mac(port_id, mac.as_mut_ptr()) };
    let mut port_mtu = mtu;
    // SAFETY: as above, one u16.
    let rc2 = unsafe { ffi::lb_dpdk_port_mtu(port_id, &mut port_mtu) };
    if rc < 0 || rc2 < 0 {
        // SAFETY: the port was opened just now with this pool and nothing else uses either.
        unsafe { ffi::lb_dpdk_port_close(port_id, pool) };
        ports.closed.insert(port_id);
        return Err(PortError::Unavailable {
            spec,
            why: format!("querying DPDK port {port_id}: {}", dpdk_strerror(rc.min(rc2))),
        });
    }
    ports.open.insert(port_id);
    Ok(DpdkPort {
        port_id,
        pool,
        mac: MacAddr(mac),
        mtu: usize::from(port_mtu).min(usize::from(frame_room) - FRAME_OVERHEAD),
        driver,
        counters: PortCounters::default(),
        backlog: [core::ptr::null_mut(); BURST],
        backlog_head: 0,
        backlog_len: 0,
        stash: Stash {
            mbufs: [core::ptr::null_mut(); BURST],
            data: [core::ptr::null(); BURST],
            len: [0; BURST],
            head: 0,
            n: 0,
        },
    })
}

/// One received burst: `mbufs[head..n]` (with their data pointers and lengths) are still to be
/// handed out; `mbufs[..head]` are freed already.
struct Stash {
    mbufs: [*mut c_void; BURST],
    data: [*const u8; BURST],
    len: [u32; BURST],
    head: usize,
    n: usize,
}

impl Stash {
    fn pending(&self) -> usize {
        self.n - self.head
    }

    /// Polls the device for up to `want` (<= BURST) frames into the empty stash; returns how many.
    fn refill(&mut self, port_id: u16, want: usize) -> usize {
        debug_assert_eq!(self.pending(), 0);
        // SAFETY: the port is open; each array holds BURST >= want entries; the previous contents
        // were all handed out and freed.
        let n = unsafe {
            ffi::lb_dpdk_rx_burst(
                port_id,
                self.mbufs.as_mut_ptr(),
                self.data.as_mut_ptr(),
                self.len.as_mut_ptr(),
                want.min(BURST) as u16,
            )
        };
        self.head = 0;
        self.n = usize::from(n);
        self.n
    }
}

/// Frees a range of received mbufs when dropped, also when the receive callback panics.
struct FreeOnDrop<'a>(&'a mut [*mut c_void]);

impl Drop for FreeOnDrop<'_> {
    fn drop(&mut self) {
        // SAFETY: the range holds received mbufs this port owns and nothing refers to any more
        // (the slices lent to the callback ended with its calls).
        unsafe { ffi::lb_dpdk_free_bulk(self.0.as_mut_ptr(), self.0.len() as c_uint) };
    }
}

impl DpdkPort {
    /// The ethdev's DPDK port id.
    pub fn port_id(&self) -> u16 {
        self.port_id
    }

    /// The DPDK driver's name (`net_af_packet`, `net_ixgbe`, ...).
    pub fn driver(&self) -> &str {
        &self.driver
    }

    /// The device's own counters.
    pub fn device_stats(&self) -> Result<DeviceStats> {
        let mut s = [0u64; 8];
        // SAFETY: the port is open; the shim writes eight u64s.
        let rc = unsafe { ffi::lb_dpdk_stats(self.port_id, s.as_mut_ptr()) };
        if rc < 0 {
            return Err(PortError::io("rte_eth_stats_get", std::io::Error::from_raw_os_error(-rc)));
        }
        Ok(DeviceStats {
            ipackets: s[0],
            opackets: s[1],
            ibytes: s[2],
            obytes: s[3],
            imissed: s[4],
            ierrors: s[5],
            oerrors: s[6],
            rx_nombuf: s[7],
        })
    }

    /// Frames filled but not yet accepted by the device.
    pub fn tx_backlog(&self) -> usize {
        self.backlog_len - self.backlog_head
    }

    /// Offers the backlog to the device again; true when it is empty afterwards.
    fn flush_backlog(&mut self) -> bool {
        let pending = self.backlog_len - self.backlog_head;
        if pending == 0 {
            return true;
        }
        // SAFETY: backlog[head..len] are filled mbufs with lengths set, owned by the port.
        let sent = unsafe {
            ffi::lb_dpdk_tx_send(
                self.port_id,
                self.backlog.as_mut_ptr().add(self.backlog_head),
                core::ptr::null(),
                pending as u16,
            )
        };
        self.backlog_head += usize::from(sent);
        if self.backlog_head == self.backlog_len {
            self.backlog_head = 0;
            self.backlog_len = 0;
            true
        } else {
            false
        }
    }
}

impl Port for DpdkPort {
    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> Result<usize> {
        let mut delivered = 0;
        let mut polled = 0;
        while delivered < max {
            if self.stash.pending() == 0 {
                // Poll again only while the device keeps filling whole requests.
                if polled >= max {
                    break;
                }
                let want = (max - polled).min(BURST);
                let got = self.stash.refill(self.port_id, want);
                polled += got;
                if got == 0 {
                    break;
                }
                if got < want {
                    polled = max;
                }
            }
            let start = self.stash.head;
            let end = self.stash.n.min(start + (max - delivered));
            self.stash.head = end;
            let Stash { mbufs, data, len, .. } = &mut self.stash;
            let _free = FreeOnDrop(&mut mbufs[start..end]);
            for i in start..end {
                if data[i].is_null() {
                    // Spread over several mbufs: longer than this port's MTU allows.
                    self.counters.rx_dropped += 1;
                    continue;
                }
                // SAFETY: the shim gave the data pointer and length of a single-segment mbuf that
                // stays allocated until `_free` drops, after this loop; nothing writes to it.
                let frame = unsafe { core::slice::from_raw_parts(data[i], len[i] as usize) };
                if frame.len() < ethernet::HEADER_LEN
                    || EtherType::from(u16::from_be_bytes([frame[12], frame[13]])) != EtherType::Lanbus
                {
                    self.counters.rx_dropped += 1;
                    continue;
                }
                self.counters.rx_frames += 1;
                self.counters.rx_bytes += frame.len() as u64;
                delivered += 1;
                on_frame(frame);
            }
        }
        Ok(delivered)
    }

    fn tx_burst(&mut self, max: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> Result<usize> {
        if !self.flush_backlog() {
            return Ok(0);
        }
        let capacity = self.frame_capacity();
        let mut taken = 0;
        while taken < max {
            let want = (max - taken).min(BURST);
            let mut mbufs = [core::ptr::null_mut::<c_void>(); BURST];
            let mut data = [core::ptr::null_mut::<u8>(); BURST];
            let mut room = [0u32; BURST];
            let mut lens = [0u32; BURST];
            // SAFETY: the pool is this port's; the arrays hold BURST >= want entries.
            let rc = unsafe {
                ffi::lb_dpdk_tx_alloc(
                    self.pool,
                    mbufs.as_mut_ptr(),
                    data.as_mut_ptr(),
                    room.as_mut_ptr(),
                    want as c_uint,
                )
            };
            if rc < 0 {
                // Mempool empty (mbufs in the rings): the caller keeps its frames for later.
                break;
            }
            let mut filled = 0;
            let mut done = false;
            while filled < want {
                let size = (room[filled] as usize).min(capacity);
                // SAFETY: data[filled] points at `room[filled]` writable bytes of an mbuf this
                // function owns; `size` is no more than that; the slice ends before the mbuf is
                // sent or freed.
                let buf = unsafe { core::slice::from_raw_parts_mut(data[filled], size) };
                match fill(buf) {
                    None => {
                        done = true;
                        break;
                    }
                    Some(n) if n == 0 || n > size => {
                        // The caller broke the contract: count it and offer the buffer again.
                        self.counters.tx_dropped += 1;
                    }
                    Some(n) => {
                        lens[filled] = n as u32;
                        self.counters.tx_frames += 1;
                        self.counters.tx_bytes += n as u64;
                        filled += 1;
                    }
                }
            }
            // SAFETY: mbufs[filled..want] were allocated above and never filled or sent.
            unsafe { ffi::lb_dpdk_free_bulk(mbufs.as_mut_ptr().add(filled), (want - filled) as c_uint) };
            if filled == 0 {
                break;
            }
            taken += filled;
            // SAFETY: mbufs[..filled] hold frames of lens[..filled] bytes (each within its room).
            let sent = usize::from(unsafe {
                ffi::lb_dpdk_tx_send(self.port_id, mbufs.as_mut_ptr(), lens.as_ptr(), filled as u16)
            });
            if sent < filled {
                // The device is full: keep the rest (lengths set) for the next call.
                let rest = filled - sent;
                self.backlog[..rest].copy_from_slice(&mbufs[sent..filled]);
                self.backlog_head = 0;
                self.backlog_len = rest;
                break;
            }
            if done {
                break;
            }
        }
        Ok(taken)
    }

    /// Polls the receive queue with growing sleeps in between ([`NAP_MIN`] doubling to
    /// [`NAP_MAX`]) until it finds frames or `timeout` passes; see the module docs.
    fn wait(&mut self, timeout: Option<Duration>) -> Result<()> {
        let start = std::time::Instant::now();
        let mut nap = NAP_MIN;
        loop {
            self.flush_backlog();
            if self.stash.pending() > 0 || self.stash.refill(self.port_id, BURST) > 0 {
                return Ok(());
            }
            let left = match timeout {
                Some(t) => match t.checked_sub(start.elapsed()) {
                    Some(left) if !left.is_zero() => left,
                    _ => return Ok(()),
                },
                None => nap,
            };
            std::thread::sleep(nap.min(left));
            nap = (nap * 2).min(NAP_MAX);
        }
    }

    fn mtu(&self) -> usize {
        self.mtu
    }

    fn mac(&self) -> MacAddr {
        self.mac
    }

    /// The port's own counts, plus the device's: `rx_dropped` adds the device's missed, erroneous
    /// and no-mbuf receive counts, `tx_dropped` its failed transmissions.
    fn counters(&self) -> PortCounters {
        let mut c = self.counters;
        if let Ok(d) = self.device_stats() {
            c.rx_dropped += d.imissed + d.ierrors + d.rx_nombuf;
            c.tx_dropped += d.oerrors;
        }
        c
    }
}

impl Drop for DpdkPort {
    fn drop(&mut self) {
        let pending = self.backlog_len - self.backlog_head;
        let stashed = self.stash.head..self.stash.n;
        drop(FreeOnDrop(&mut self.stash.mbufs[stashed]));
        // SAFETY: the backlog mbufs are owned by the port and not sent; freeing them (and the
        // stash, above) and then
        // stopping and closing the port (which returns the rings' mbufs) before freeing its pool
        // leaves no mbuf of the pool in use. Nothing uses the port afterwards.
        unsafe {
            ffi::lb_dpdk_free_bulk(self.backlog.as_mut_ptr().add(self.backlog_head), pending as c_uint);
            ffi::lb_dpdk_port_close(self.port_id, self.pool);
        }
        let mut ports = PORTS.lock().unwrap_or_else(|p| p.into_inner());
        ports.open.remove(&self.port_id);
        ports.closed.insert(self.port_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eal_args_split_at_whitespace() {
        assert_eq!(
            split_eal_args("  --no-huge\t-m 256  --vdev=net_af_packet0,iface=eth1 "),
            ["--no-huge", "-m", "256", "--vdev=net_af_packet0,iface=eth1"]
        );
        assert!(split_eal_args("   ").is_empty());
    }

    #[test]
    fn defaults_fit_one_frame_per_mbuf() {
        let o = DpdkOptions::default();
        assert_eq!(o.port_id, 0);
        assert!(o.mbufs > u32::from(o.rx_descriptors) + u32::from(o.tx_descriptors));
        assert!(!DPDK_VERSION.is_empty());
    }
}
