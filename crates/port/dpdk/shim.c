/*
 * lanbus DPDK shim: the few DPDK calls Rust cannot make directly, behind a narrow C API of plain
 * types (declared again in crates/port/src/dpdk/ffi.rs; keep the two in step).
 *
 * Why C at all: rte_eth_rx_burst, rte_eth_tx_burst, rte_pktmbuf_alloc_bulk and the mbuf field
 * accessors are static inline functions in DPDK's headers, and struct rte_mbuf's layout depends on
 * the build. Everything else could be called from Rust, but keeping all DPDK calls here means the
 * Rust side never sees a DPDK struct: it handles mbufs as opaque pointers.
 *
 * Conventions: functions that can fail return 0 or a negative errno; `stage` out-parameters name
 * the DPDK call that failed (a static string). One rx queue (0) and one tx queue (0) per port.
 * Built against DPDK 22.11 (Debian bookworm's libdpdk-dev).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_mbuf.h>
#include <rte_mempool.h>

/* Initialises the EAL with the given argv (argv[0] is a program name). Returns the number of
 * arguments EAL consumed, or a negative errno (rte_errno) on failure.
 *
 * rte_eal_init pins the calling thread to its main lcore's CPU. lanbus does not run on EAL lcores
 * (the port is polled by whichever thread owns it), so the thread's CPU affinity is put back as it
 * was: otherwise every thread the caller spawns later would inherit the pinning. */
int lb_dpdk_eal_init(int argc, char **argv)
{
    cpu_set_t before;
    int have_before = pthread_getaffinity_np(pthread_self(), sizeof(before), &before) == 0;
    int ret = rte_eal_init(argc, argv);
    if (have_before)
        pthread_setaffinity_np(pthread_self(), sizeof(before), &before);
    if (ret < 0) {
        int e = rte_errno;
        return e > 0 ? -e : -EINVAL;
    }
    return ret;
}

/* DPDK's text for an errno value (including DPDK's own codes above __ELASTERROR). */
const char *lb_dpdk_strerror(int err)
{
    return rte_strerror(err < 0 ? -err : err);
}

/* Number of Ethernet ports the EAL probed (PCI devices bound to a DPDK driver, vdevs). */
int lb_dpdk_port_count(void)
{
    return (int)rte_eth_dev_count_avail();
}

/* Whether `port` names a probed ethdev. */
int lb_dpdk_port_valid(uint16_t port)
{
    return rte_eth_dev_is_valid_port(port);
}

/* The port id of the ethdev named `name` (a vdev's name such as "net_ring0", or a PCI address). */
int lb_dpdk_port_by_name(const char *name, uint16_t *port)
{
    return rte_eth_dev_get_port_by_name(name, port);
}

/* Writes the driver's name (e.g. "net_af_packet") into buf, NUL-terminated. */
int lb_dpdk_port_driver(uint16_t port, char *buf, size_t len)
{
    struct rte_eth_dev_info info;
    int ret = rte_eth_dev_info_get(port, &info);
    if (ret < 0)
        return ret;
    snprintf(buf, len, "%s", info.driver_name ? info.driver_name : "?");
    return 0;
}

/*
 * Configures and starts `port` with one rx and one tx queue. Creates a mempool named `pool_name`
 * of `n_mbufs` mbufs whose data room holds `frame_room` bytes after the default headroom. If
 * `mtu` is non-zero and differs from the port's, the port's MTU is set first. `promiscuous` non-zero receives every frame;
 * otherwise the NIC's MAC filter applies (own address, broadcast, and all multicast).
 * On success *pool_out is the mempool (for lb_dpdk_tx_alloc and lb_dpdk_port_close).
 */
int lb_dpdk_port_open(uint16_t port, const char *pool_name, uint32_t n_mbufs, uint16_t frame_room,
                      uint16_t rx_desc, uint16_t tx_desc, uint16_t mtu, int promiscuous,
                      void **pool_out, const char **stage)
{
    struct rte_eth_conf conf;
    struct rte_mempool *pool;
    int socket = rte_eth_dev_socket_id(port);
    unsigned cache;
    int ret;

    *pool_out = NULL;
    if (!rte_eth_dev_is_valid_port(port)) {
        *stage = "rte_eth_dev_is_valid_port";
        return -ENODEV;
    }
    if (socket < 0)
        socket = (int)rte_socket_id();
    if (socket < 0)
        socket = 0;

    /* Per-lcore cache: DPDK requires cache <= n / 1.5; threads that are not EAL lcores skip it. */
    cache = n_mbufs / 2 < 256 ? n_mbufs / 2 : 256;
    pool = rte_pktmbuf_pool_create(pool_name, n_mbufs, cache, 0,
                                   (uint16_t)(RTE_PKTMBUF_HEADROOM + frame_room), socket);
    if (pool == NULL) {
        *stage = "rte_pktmbuf_pool_create";
        return rte_errno > 0 ? -rte_errno : -ENOMEM;
    }

    memset(&conf, 0, sizeof(conf));
    ret = rte_eth_dev_configure(port, 1, 1, &conf);
    if (ret < 0) {
        *stage = "rte_eth_dev_configure";
        goto fail;
    }
    uint16_t current = 0;
    if (mtu != 0 && (rte_eth_dev_get_mtu(port, &current) != 0 || current != mtu)) {
        ret = rte_eth_dev_set_mtu(port, mtu);
        if (ret < 0) {
            *stage = "rte_eth_dev_set_mtu";
            goto fail;
        }
    }
    ret = rte_eth_dev_adjust_nb_rx_tx_desc(port, &rx_desc, &tx_desc);
    if (ret < 0) {
        *stage = "rte_eth_dev_adjust_nb_rx_tx_desc";
        goto fail;
    }
    ret = rte_eth_rx_queue_setup(port, 0, rx_desc, (unsigned)socket, NULL, pool);
    if (ret < 0) {
        *stage = "rte_eth_rx_queue_setup";
        goto fail;
    }
    ret = rte_eth_tx_queue_setup(port, 0, tx_desc, (unsigned)socket, NULL);
    if (ret < 0) {
        *stage = "rte_eth_tx_queue_setup";
        goto fail;
    }
    ret = rte_eth_dev_start(port);
    if (ret < 0) {
        *stage = "rte_eth_dev_start";
        goto fail;
    }
    /* Filters: failure to change them is not fatal for drivers that lack the operation
     * (-ENOTSUP), but anything else is. */
    ret = promiscuous ? rte_eth_promiscuous_enable(port) : rte_eth_allmulticast_enable(port);
    if (ret < 0 && ret != -ENOTSUP) {
        *stage = promiscuous ? "rte_eth_promiscuous_enable" : "rte_eth_allmulticast_enable";
        rte_eth_dev_stop(port);
        goto fail;
    }
    *pool_out = pool;
    return 0;

fail:
    rte_mempool_free(pool);
    return ret;
}

/* Stops and closes the port and frees its mempool. */
void lb_dpdk_port_close(uint16_t port, void *pool)
{
    rte_eth_dev_stop(port);
    rte_eth_dev_close(port);
    rte_mempool_free((struct rte_mempool *)pool);
}

/* The port's MAC address into mac[6]. */
int lb_dpdk_port_mac(uint16_t port, uint8_t *mac)
{
    struct rte_ether_addr addr;
    int ret = rte_eth_macaddr_get(port, &addr);
    if (ret < 0)
        return ret;
    memcpy(mac, addr.addr_bytes, RTE_ETHER_ADDR_LEN);
    return 0;
}

/* The port's MTU (Ethernet payload bytes). */
int lb_dpdk_port_mtu(uint16_t port, uint16_t *mtu)
{
    return rte_eth_dev_get_mtu(port, mtu);
}

/*
 * Receives up to `max` frames from queue 0. For each, mbufs[i] is the mbuf (free it with
 * lb_dpdk_free_bulk), data[i] its first byte and len[i] its length. A frame that spans several
 * segments (longer than one mbuf) gets data[i] = NULL: the caller drops it.
 */
uint16_t lb_dpdk_rx_burst(uint16_t port, void **mbufs, const uint8_t **data, uint32_t *len, uint16_t max)
{
    struct rte_mbuf **m = (struct rte_mbuf **)mbufs;
    uint16_t n = rte_eth_rx_burst(port, 0, m, max);
    for (uint16_t i = 0; i < n; i++) {
        if (m[i]->nb_segs != 1) {
            data[i] = NULL;
            len[i] = m[i]->pkt_len;
        } else {
            data[i] = rte_pktmbuf_mtod(m[i], const uint8_t *);
            len[i] = m[i]->data_len;
        }
    }
    return n;
}

/* Frees `n` mbufs (any of them may be NULL). */
void lb_dpdk_free_bulk(void **mbufs, unsigned n)
{
    rte_pktmbuf_free_bulk((struct rte_mbuf **)mbufs, n);
}

/*
 * Allocates `n` mbufs from `pool` for transmission: mbufs[i] is the mbuf, data[i] its data area
 * and room[i] how many bytes it holds. All or nothing: returns 0 or -ENOBUFS.
 */
int lb_dpdk_tx_alloc(void *pool, void **mbufs, uint8_t **data, uint32_t *room, unsigned n)
{
    struct rte_mbuf **m = (struct rte_mbuf **)mbufs;
    if (rte_pktmbuf_alloc_bulk((struct rte_mempool *)pool, m, n) != 0)
        return -ENOBUFS;
    for (unsigned i = 0; i < n; i++) {
        data[i] = rte_pktmbuf_mtod(m[i], uint8_t *);
        room[i] = rte_pktmbuf_tailroom(m[i]);
    }
    return 0;
}

/*
 * Sends mbufs[0..n) on queue 0. If `len` is not NULL, frame i is first given length len[i] (bytes
 * already written at its data area, at most the room lb_dpdk_tx_alloc gave); with NULL the
 * lengths were set by an earlier call (a retry). The device owns the mbufs it accepted, a prefix
 * of the array; the caller keeps the rest, to retry or to free with lb_dpdk_free_bulk. Returns how
 * many were accepted.
 */
uint16_t lb_dpdk_tx_send(uint16_t port, void **mbufs, const uint32_t *len, uint16_t n)
{
    struct rte_mbuf **m = (struct rte_mbuf **)mbufs;
    if (len != NULL) {
        for (uint16_t i = 0; i < n; i++) {
            m[i]->data_len = (uint16_t)len[i];
            m[i]->pkt_len = len[i];
        }
    }
    return rte_eth_tx_burst(port, 0, m, n);
}

/* Device statistics (rte_eth_stats_get) as plain numbers, in this order: ipackets, opackets,
 * ibytes, obytes, imissed, ierrors, oerrors, rx_nombuf. */
int lb_dpdk_stats(uint16_t port, uint64_t *out)
{
    struct rte_eth_stats s;
    int ret = rte_eth_stats_get(port, &s);
    if (ret < 0)
        return ret;
    out[0] = s.ipackets;
    out[1] = s.opackets;
    out[2] = s.ibytes;
    out[3] = s.obytes;
    out[4] = s.imissed;
    out[5] = s.ierrors;
    out[6] = s.oerrors;
    out[7] = s.rx_nombuf;
    return 0;
}
