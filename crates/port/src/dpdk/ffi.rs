//! The C shim's API (`crates/port/dpdk/shim.c`), declared for Rust. Plain types only: mbufs and
//! mempools are opaque pointers the Rust side never dereferences.
//!
//! Every function here is unsafe to call; the contracts are those written in shim.c. In short:
//! `lb_dpdk_eal_init` once per process before anything else; port functions only on a port
//! opened with `lb_dpdk_port_open` and not yet closed; rx/tx on one port from one thread at a time
//! (DPDK queues are not thread-safe); array arguments hold at least the count given.

use core::ffi::{c_char, c_int, c_uint, c_void};

extern "C" {
    /// `rte_eal_init(argc, argv)`: arguments consumed, or a negative errno.
    pub fn lb_dpdk_eal_init(argc: c_int, argv: *mut *mut c_char) -> c_int;
    /// DPDK's static message for an errno (positive or negative).
    pub fn lb_dpdk_strerror(err: c_int) -> *const c_char;
    /// Number of probed ethdev ports.
    pub fn lb_dpdk_port_count() -> c_int;
    /// Whether `port` is a probed ethdev (non-zero: yes).
    pub fn lb_dpdk_port_valid(port: u16) -> c_int;
    /// The port id of the ethdev called `name` into `*port`; 0 or a negative errno.
    pub fn lb_dpdk_port_by_name(name: *const c_char, port: *mut u16) -> c_int;
    /// The driver name into `buf` (NUL-terminated, truncated to `len`).
    pub fn lb_dpdk_port_driver(port: u16, buf: *mut c_char, len: usize) -> c_int;
    /// Creates the mempool, configures one rx and one tx queue, starts the port.
    #[allow(clippy::too_many_arguments)]
    pub fn lb_dpdk_port_open(
        port: u16,
        pool_name: *const c_char,
        n_mbufs: u32,
        frame_room: u16,
        rx_desc: u16,
        tx_desc: u16,
        mtu: u16,
        promiscuous: c_int,
        pool_out: *mut *mut c_void,
        stage: *mut *const c_char,
    ) -> c_int;
    /// Stops and closes the port, frees the mempool.
    pub fn lb_dpdk_port_close(port: u16, pool: *mut c_void);
    /// MAC address into `mac[6]`.
    pub fn lb_dpdk_port_mac(port: u16, mac: *mut u8) -> c_int;
    /// MTU into `*mtu`.
    pub fn lb_dpdk_port_mtu(port: u16, mtu: *mut u16) -> c_int;
    /// Receives up to `max` frames; per frame: mbuf, data pointer (NULL if multi-segment), length.
    pub fn lb_dpdk_rx_burst(
        port: u16,
        mbufs: *mut *mut c_void,
        data: *mut *const u8,
        len: *mut u32,
        max: u16,
    ) -> u16;
    /// Frees `n` mbufs (NULL entries allowed).
    pub fn lb_dpdk_free_bulk(mbufs: *mut *mut c_void, n: c_uint);
    /// Allocates `n` mbufs (all or none): per mbuf its data area and room. 0 or -ENOBUFS.
    pub fn lb_dpdk_tx_alloc(
        pool: *mut c_void,
        mbufs: *mut *mut c_void,
        data: *mut *mut u8,
        room: *mut u32,
        n: c_uint,
    ) -> c_int;
    /// Sends `n` filled mbufs, setting their lengths first unless `len` is null (a retry); returns
    /// how many were accepted (a prefix); the caller keeps the rest.
    pub fn lb_dpdk_tx_send(port: u16, mbufs: *mut *mut c_void, len: *const u32, n: u16) -> u16;
    /// `rte_eth_stats_get` into `out[8]`: ipackets, opackets, ibytes, obytes, imissed, ierrors,
    /// oerrors, rx_nombuf.
    pub fn lb_dpdk_stats(port: u16, out: *mut u64) -> c_int;
}
