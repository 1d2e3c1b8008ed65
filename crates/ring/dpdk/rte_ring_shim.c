/*
 * lanbus-ring's DPDK peer shim (cargo feature `dpdk`): DPDK's rte_ring, built from Debian's
 * libdpdk-dev 22.11, behind a narrow C API so `lanbus bench ring` can drive rte_ring through the
 * very loop it drives our ring with. Declared again in crates/ring/src/rte.rs; keep the two in step.
 *
 * Why C: rte_ring's enqueue and dequeue are static inline functions in DPDK's headers. The ring is
 * laid out by rte_ring_init in memory allocated here (rte_ring_create would need an initialised
 * EAL for its memzone; rte_ring_init does not), aligned to 128 bytes, at least what a memzone gives.
 * The calls are the ones DPDK 22.11's ring_perf_autotest makes for its "legacy APIs: SP/SC: bulk"
 * lines: rte_ring_sp_enqueue_bulk / rte_ring_sc_dequeue_bulk of 8-byte pointers.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>

#include <rte_ring.h>

/* A new empty single-producer single-consumer ring of `count` slots (a power of two; holds
 * count - 1), or NULL. Free it with lb_rte_ring_free. */
struct rte_ring *lb_rte_ring_new(unsigned int count)
{
    ssize_t size = rte_ring_get_memsize(count);
    void *mem = NULL;
    if (size < 0 || posix_memalign(&mem, 128, (size_t)size) != 0)
        return NULL;
    if (rte_ring_init(mem, "lanbus_peer", count, RING_F_SP_ENQ | RING_F_SC_DEQ) != 0) {
        free(mem);
        return NULL;
    }
    return mem;
}

void lb_rte_ring_free(struct rte_ring *r)
{
    free(r);
}

/* Enqueues all `n` pointers or none; returns n or 0 (rte_ring_sp_enqueue_bulk). */
unsigned int lb_rte_ring_sp_enqueue_bulk(struct rte_ring *r, void *const *objs, unsigned int n)
{
    return rte_ring_sp_enqueue_bulk(r, objs, n, NULL);
}

/* Dequeues exactly `n` pointers or none; returns n or 0 (rte_ring_sc_dequeue_bulk). */
unsigned int lb_rte_ring_sc_dequeue_bulk(struct rte_ring *r, void **objs, unsigned int n)
{
    return rte_ring_sc_dequeue_bulk(r, objs, n, NULL);
}
